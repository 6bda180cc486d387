/* The tensor-parallel collectives of a sharded step graph, between the rank processes of one host, through one
 * shared-memory segment (runner/core/shared_segment.py: the runner creates it and hands it to this library with
 * llm_tp_attach before any session runs; each process is one rank).
 *
 * AllReduce: the elementwise fp32 sum of every rank's tensor. AllGather: every rank's [rows, size_r] slice of the
 * last axis, concatenated in rank order ([rows, total]). Every rank sums (or copies) in rank order, so all ranks get
 * the same bits. A call moves its tensor in rounds of at most SLOT bytes per rank: a rank writes its part into its
 * own slot, publishes the round's number, waits until every rank has published it, and reads every slot. Slots
 * alternate between two buffers by round: a rank reaches round g + 2 only after every rank published g + 1, which
 * each does after reading round g, so no slot is overwritten while it is read.
 *
 * A wait spins (each rank has its own core: the runner sets one thread per rank where cores are few; it yields now
 * and then, for machines with fewer cores than ranks) and gives up
 * with an error when the segment is marked aborted (a rank failed, or the runner shuts down), when a rank's process
 * is gone, or after the segment's timeout: a dead or hung rank becomes an error in every other rank, never a hang.
 */
#include "ort_abi.h"

#include <errno.h>
#include <sched.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_RANKS 64
#define SLOT (4 << 20) /* bytes of one rank's buffer in one round; two per rank */
#define LINE 64

typedef struct {
  _Atomic int64_t aborted; /* non-zero: every wait fails at once */
  int64_t ranks;
  int64_t timeout_ms;
  int64_t pids[MAX_RANKS];
  struct {
    _Atomic uint64_t round; /* the last round this rank published */
    int64_t offset, size;   /* AllGather: where this rank's columns go, and how many */
    char pad[LINE - 3 * sizeof(int64_t)];
  } published[MAX_RANKS];
} Header;

#define HEADER_BYTES ((sizeof(Header) + 4095) / 4096 * 4096)

/* this process's rank in the segment it attached (one per process), and the time its collectives took */
static struct {
  char *base;
  int rank;
  uint64_t round;        /* rounds this rank has run */
  int64_t collective_ns; /* in AllReduce / AllGather calls, all of it */
  int64_t waiting_ns;    /* of which waiting for the other ranks */
} group = {NULL, -1, 0, 0, 0};

size_t llm_tp_segment_bytes(int ranks) { return HEADER_BYTES + (size_t)ranks * 2 * SLOT; }

static Header *header(void) { return (Header *)group.base; }
static char *slot(int rank, uint64_t round) { return group.base + HEADER_BYTES + ((size_t)rank * 2 + (round & 1)) * SLOT; }

/* Map the segment `path` (a file of llm_tp_segment_bytes(ranks) zero bytes, made by the runner) as rank `rank`.
 * Rank 0 writes the rank count and timeout; every rank writes its process id. Returns 0, or -errno. */
__attribute__((visibility("default"))) int llm_tp_attach(const char *path, int rank, int ranks, int64_t timeout_ms) {
  if (ranks < 1 || ranks > MAX_RANKS || rank < 0 || rank >= ranks) return -EINVAL;
  int fd = open(path, O_RDWR);
  if (fd < 0) return -errno;
  void *base = mmap(NULL, llm_tp_segment_bytes(ranks), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int error = errno;
  close(fd);
  if (base == MAP_FAILED) return -error;
  if (group.base) munmap(group.base, llm_tp_segment_bytes((int)header()->ranks));
  group.base = base;
  group.rank = rank;
  group.round = 0;
  Header *h = header();
  if (rank == 0) {
    h->ranks = ranks;
    h->timeout_ms = timeout_ms;
  }
  h->pids[rank] = getpid();
  return 0;
}

/* The nanoseconds this rank spent in collectives and, of those, waiting for the other ranks (benchmarks). */
__attribute__((visibility("default"))) void llm_tp_times(int64_t out[2]) {
  out[0] = group.collective_ns;
  out[1] = group.waiting_ns;
}

/* Whether the segment is marked aborted: a rank failed, or a wait gave up on a rank that did not arrive. */
__attribute__((visibility("default"))) int llm_tp_aborted(void) { return group.base && atomic_load(&header()->aborted); }

/* Make every rank's waits fail (a rank failed or is shutting down). */
__attribute__((visibility("default"))) void llm_tp_abort(void) {
  if (group.base) atomic_store(&header()->aborted, 1);
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Publish `round` and wait until every rank has; NULL, or why not (the segment is then marked aborted). */
static const char *wait_for_ranks(uint64_t round);

static const char *arrive(uint64_t round) {
  int64_t start = now_ns();
  const char *why = wait_for_ranks(round);
  group.waiting_ns += now_ns() - start;
  return why;
}

static const char *wait_for_ranks(uint64_t round) {
  Header *h = header();
  atomic_store_explicit(&h->published[group.rank].round, round, memory_order_release);
  int64_t ranks = h->ranks, started = 0;
  for (int64_t p = 0; p < ranks; p++) {
    for (uint64_t spins = 1; atomic_load_explicit(&h->published[p].round, memory_order_acquire) < round; spins++) {
      __builtin_ia32_pause();
      if (spins % 4096) continue;
      sched_yield(); /* where ranks outnumber the cores, the rank waited for may need this one */
      if (atomic_load(&h->aborted)) return "another rank failed or the group is shutting down";
      int64_t now = now_ns() / 1000000;
      if (!started) started = now;
      if (kill((pid_t)h->pids[p], 0) != 0 && errno == ESRCH) {
        atomic_store(&h->aborted, 1);
        return "a rank's process is gone";
      }
      if (now - started > h->timeout_ms) {
        atomic_store(&h->aborted, 1);
        return "a rank did not arrive within the timeout (hung?)";
      }
    }
  }
  return NULL;
}

typedef struct {
  OrtApiTable api;
  int gather;
  int64_t offset, total; /* AllGather: this rank's first column and the gathered width */
} Kernel;

static OrtStatus *refuse(const Kernel *kernel, const char *message) {
  char named[256];
  snprintf(named, sizeof(named), "%s (rank %d): %s", kernel->gather ? "AllGather" : "AllReduce", group.rank, message);
  return fail(kernel->api, named);
}

static OrtStatus *all_reduce(const Kernel *kernel, const float *x, float *y, int64_t count) {
  Header *h = header();
  const int64_t per_round = SLOT / sizeof(float);
  for (int64_t start = 0; start < count; start += per_round) {
    int64_t n = count - start < per_round ? count - start : per_round;
    uint64_t round = ++group.round;
    memcpy(slot(group.rank, round), x + start, (size_t)n * sizeof(float));
    const char *why = arrive(round);
    if (why) return refuse(kernel, why);
    const float *first = (const float *)slot(0, round);
    for (int64_t i = 0; i < n; i++) y[start + i] = first[i];
    for (int64_t p = 1; p < h->ranks; p++) {
      const float *part = (const float *)slot((int)p, round);
      for (int64_t i = 0; i < n; i++) y[start + i] += part[i];
    }
  }
  return NULL;
}

static OrtStatus *all_gather(const Kernel *kernel, const float *x, float *y, int64_t rows, int64_t size) {
  Header *h = header();
  int64_t per_round = SLOT / (int64_t)sizeof(float) / (kernel->total > 0 ? kernel->total : 1);
  if (per_round < 1) return refuse(kernel, "a row is wider than the shared slot");
  h->published[group.rank].offset = kernel->offset;
  h->published[group.rank].size = size;
  for (int64_t start = 0; start < rows; start += per_round) {
    int64_t n = rows - start < per_round ? rows - start : per_round;
    uint64_t round = ++group.round;
    memcpy(slot(group.rank, round), x + start * size, (size_t)(n * size) * sizeof(float));
    const char *why = arrive(round);
    if (why) return refuse(kernel, why);
    for (int64_t p = 0; p < h->ranks; p++) {
      int64_t offset = h->published[p].offset, width = h->published[p].size;
      if (offset < 0 || offset + width > kernel->total) return refuse(kernel, "the ranks' slices do not fit the gathered axis");
      const float *part = (const float *)slot((int)p, round);
      for (int64_t r = 0; r < n; r++)
        memcpy(y + (start + r) * kernel->total + offset, part + r * width, (size_t)width * sizeof(float));
    }
  }
  return NULL;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const Kernel *kernel = state;
  OrtApiTable api = kernel->api;
  if (!group.base) return refuse(kernel, "no tensor-parallel group: this engine's ranks are started by the runner");
  const OrtValue *input = NULL;
  void *x = NULL, *y = NULL;
  int64_t dims[4], ignored[4];
  size_t rank = 0;
  int element_type = 0;
  if (API(api, KernelContext_GetInput, OrtStatus *(*)(const OrtKernelContext *, size_t, const OrtValue **))(context, 0, &input) ||
      !input || !tensor_typed(api, input, &x, dims, &rank, &element_type) || element_type != ELEMENT_FLOAT || rank < 1)
    return refuse(kernel, "takes one float tensor of 1 to 4 dimensions");
  int64_t count = 1;
  for (size_t i = 0; i < rank; i++) count *= dims[i];
  int64_t out_dims[4];
  memcpy(out_dims, dims, sizeof(out_dims));
  if (kernel->gather) out_dims[rank - 1] = kernel->total;
  OrtValue *output = NULL;
  if (API(api, KernelContext_GetOutput, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))(
          context, 0, out_dims, rank, &output) || !tensor(api, output, &y, ignored))
    return refuse(kernel, "cannot allocate its output");
  int64_t start = now_ns(), size = dims[rank - 1];
  OrtStatus *status = kernel->gather ? all_gather(kernel, x, y, size ? count / size : 0, size) : all_reduce(kernel, x, y, count);
  group.collective_ns += now_ns() - start;
  return status;
}

static OrtStatus *create(int gather, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  Kernel *kernel = calloc(1, sizeof(Kernel));
  if (!kernel) return fail(api, "collective: out of memory");
  kernel->api = api;
  kernel->gather = gather;
  OrtStatus *(*get_int)(const OrtKernelInfo *, const char *, int64_t *) =
      API(api, KernelInfoGetAttribute_int64, OrtStatus *(*)(const OrtKernelInfo *, const char *, int64_t *));
  OrtStatus *status = NULL;
  if (gather) status = get_int(info, "offset", &kernel->offset);
  if (gather && !status) status = get_int(info, "total", &kernel->total);
  if (status) {
    free(kernel);
    return status;
  }
  *out = kernel;
  return NULL;
}

static OrtStatus *create_reduce(const OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  (void)op;
  return create(0, api, info, out);
}
static OrtStatus *create_gather(const OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  (void)op;
  return create(1, api, info, out);
}
static void destroy(void *kernel) { free(kernel); }
static const char *reduce_name(const OrtCustomOp *op) { (void)op; return "AllReduce"; }
static const char *gather_name(const OrtCustomOp *op) { (void)op; return "AllGather"; }
static int input_type(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return ELEMENT_FLOAT; }
static size_t one_tensor(const OrtCustomOp *op) { (void)op; return 1; }

OrtCustomOp all_reduce_op = CPU_CUSTOM_OP(reduce_name, input_type, one_tensor, required, one_tensor, create_reduce, compute, destroy);
OrtCustomOp all_gather_op = CPU_CUSTOM_OP(gather_name, input_type, one_tensor, required, one_tensor, create_gather, compute, destroy);
