"""`runner generate | chat | serve | bench | eval | info ENGINE ...`"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from engines.cli_errors import exit_on
from engines.format import ArtifactError, open_artifact
from runner.core.args import (
    DEFAULT_NUM_SCHEDULER_STEPS,
    DEFAULT_SHARED_PREFILL_CHUNK,
    DEFAULT_SPECULATIVE_MAX_ROWS,
    EngineArgs,
)
from runner.core.engine import LLMEngine, PromptError
from runner.core.request import Request
from runner.core.tokenizer import ChatTemplateError, read_chat_template
from runner.llm import LLM
from runner.sampling.params import SamplingParams
from runner.sampling.structured import DEFAULT_GRAMMAR_TIMEOUT, GRAMMAR_MEMORY_MIB, StructuredOutputs
from runner.serving import DEFAULT_MAX_BODY_BYTES
from runner.serving.tool_parsers import PARSERS
from runner.tools.info import describe


@click.group()
@click.version_option(package_name="llm-engine-builder")
def main() -> None:
    """Run engines built by `builder build`."""


def sampling_options(command):
    """The options `generate` and `chat` share: sampling, threads, stats."""
    options = [
        click.option("--max-tokens", type=int, default=128, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", type=int, default=-1, show_default=True),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--min-p", type=float, default=0.0, show_default=True),
        click.option(
            "--repetition-penalty", type=float, default=1.0, show_default=True, help="> 1 discourages repeats."
        ),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True),
        click.option("--stop", multiple=True, help="End the answer before this text (repeat the option)."),
        click.option("--ignore-eos", is_flag=True, help="Go on past the end-of-sequence token (up to --max-tokens)."),
        click.option("--seed", type=int, default=None),
        click.option(
            "--json-schema", default=None, help="Answer in JSON following this schema (a file, or the JSON itself)."
        ),
        click.option("--regex", default=None, help="Answer with text matching this regular expression."),
        click.option("--choice", multiple=True, help="Answer with one of these strings (repeat the option)."),
        click.option("--threads", type=int, default=None, help="CPU threads (default: onnxruntime's choice)."),
        click.option("--stats/--no-stats", default=True, help="Print token counts and speed to stderr."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def sampling_params(json_schema, regex, choice, stop, **sampling) -> SamplingParams:
    """SamplingParams from the shared options (the others are SamplingParams' fields by name); --json-schema /
    --regex / --choice become structured outputs."""
    structured = None
    if json_schema is not None:
        path = Path(json_schema)
        structured = StructuredOutputs(json=path.read_text() if path.is_file() else json_schema)
    if regex is not None or choice:
        if structured is not None or (regex is not None and choice):
            raise ValueError("give one of --json-schema, --regex, --choice")
        structured = StructuredOutputs(regex=regex) if regex is not None else StructuredOutputs(choice=list(choice))
    return SamplingParams(**sampling, stop=list(stop), structured_outputs=structured)


def _chat_template(ctx, param, value: str | None) -> str | None:
    """--chat-template's value read as vLLM reads it: a file's path, or the template itself."""
    try:
        return None if value is None else read_chat_template(value)
    except ChatTemplateError as err:
        raise click.BadParameter(str(err)) from None


CHAT_TEMPLATE_HELP = "A Jinja chat template (a file, or the template itself) instead of the engine's."


def chat_template_option(help_text: str = CHAT_TEMPLATE_HELP):
    return click.option("--chat-template", default=None, callback=_chat_template, help=help_text)


@main.command()
@click.argument("engine", type=click.Path())
@click.argument("prompt")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt as a user message in the chat template.")
@chat_template_option()
@sampling_options
def generate(engine, prompt, chat, chat_template, threads, stats, **sampling) -> None:
    """Generate a completion of PROMPT with ENGINE, streamed to stdout."""
    with exit_on(ArtifactError, PromptError, ChatTemplateError, ValueError):
        params = sampling_params(**sampling)
        llm = LLM(
            engine, threads=threads, max_batch=1, chat_template=chat_template
        )  # one request: no padding for batch invariance
        if chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        stream_reply(llm, llm.tokenizer.encode(prompt), params, stats)


@main.command()
@click.argument("engine", type=click.Path())
@click.option("--system", default=None, help="A system message that opens the conversation.")
@chat_template_option()
@sampling_options
def chat(engine, system, chat_template, threads, stats, **sampling) -> None:
    """Chat with ENGINE: one user message per line on stdin, each reply streamed to stdout.

    The conversation is kept, and its earlier turns are not computed again (prefix caching): a turn costs its new
    message, not the whole history. When the history outgrows the engine's sequence length, the oldest turns are
    dropped (the system message stays). `/reset` starts a new conversation; an empty line or end of input ends."""
    with exit_on(ArtifactError, ChatTemplateError, ValueError):
        params = sampling_params(**sampling)
        llm = LLM(engine, threads=threads, max_batch=1, enable_prefix_caching=True, chat_template=chat_template)
        opening = [{"role": "system", "content": system}] if system else []
        llm.tokenizer.apply_chat_template(opening)  # an engine without a chat template fails here, not mid-conversation
        llm.engine.new_requests("", [0], params)  # and so does a schema or regex that does not compile (not run)
    room = min(
        params.max_tokens, llm.engine.max_seq_len // 4
    )  # an over-long history leaves at least this much to answer in
    messages = list(opening)
    while True:
        if sys.stdin.isatty():
            click.echo("> ", nl=False, err=True)
        line = sys.stdin.readline().strip()
        if not line:
            return
        if line == "/reset":
            messages = list(opening)
            continue
        messages.append({"role": "user", "content": line})
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages))
        while len(ids) > llm.engine.max_seq_len - room and len(messages) > len(opening) + 1:
            del messages[len(opening) : len(opening) + 2]  # the oldest user message and its reply
            ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages))
            click.echo("[the conversation outgrew the engine's sequence length: its oldest turn was dropped]", err=True)
        try:
            request = stream_reply(llm, ids, params, stats)
        except PromptError as err:  # the message alone is too long: say so, and the conversation goes on without it
            click.echo(f"error: {err}", err=True)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": request.text})


def stream_reply(llm: LLM, prompt_ids: list[int], params: SamplingParams, stats: bool) -> Request:
    """Generate from `prompt_ids` with the text streamed to stdout, then (`stats`) a line of counts and speed."""
    start = time.perf_counter()
    request = llm.engine.add_request(None, prompt_ids, params)
    first = None
    for event in llm.engine.run([request]):
        first = first or time.perf_counter()
        click.echo(event.delta, nl=False)
    click.echo()
    if stats:
        decode_s = time.perf_counter() - first
        generated = len(request.output_token_ids)
        cached = f" ({request.num_cached_tokens} cached)" if request.num_cached_tokens else ""
        click.echo(
            f"[{len(request.prompt_token_ids)} prompt tokens{cached}, first token after {(first - start) * 1000:.0f} "
            "ms, "
            f"{generated} tokens, {(generated - 1) / decode_s if generated > 1 else 0:.1f} tok/s decode, "
            f"finish: {request.finish_reason}]",
            err=True,
        )
    return request


def origin_list(values: tuple[str, ...]) -> list[str]:
    """--allowed-origins, repeated or as a JSON list (vLLM's form)."""
    import json

    origins = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                listed = json.loads(value)
            except json.JSONDecodeError as err:
                raise click.BadParameter(f"not a JSON list: {err}", param_hint="--allowed-origins") from None
            origins += [str(v) for v in listed]
        else:
            origins.append(value)
    return origins


class AutoOrCount(click.ParamType):
    """`auto` or a count >= 0."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        try:
            count = int(value)
        except ValueError:
            count = -1
        if count < 0:
            self.fail(f"{value!r} is neither 'auto' nor a count >= 0", param, ctx)
        return count


AUTO_OR_COUNT = AutoOrCount()

PADDED_ROWS_NOTE = (
    "note: a lone request runs as two rows: this engine's matmuls round one row differently "
    "from several on this machine, and padding keeps greedy answers the same alone or batched "
    "(--max-batch 1 turns it off)"
)


# The options `serve` and `run-batch` share: how the engine runs and reads requests.
SERVED_ENGINE_OPTIONS = [
    click.option(
        "--max-batch",
        "--max-num-seqs",
        "max_batch",
        type=int,
        default=None,
        help="Requests decoded together (default: the engine's largest bucket; --max-num-seqs is vLLM's name).",
    ),
    click.option("--threads", type=int, default=None, help="CPU threads (default: onnxruntime's choice)."),
    click.option(
        "--model-name",
        "--served-model-name",
        "model_name",
        default=None,
        help="Name requests give in `model` (default: the engine directory's name; --served-model-name is vLLM's).",
    ),
    click.option(
        "--enable-prefix-caching",
        is_flag=True,
        help="Start a prompt after the longest prefix a cache row "
        "holds from an earlier or running request (a chat's earlier turns, a shared system prompt); greedy "
        "tokens may then differ at near-ties.",
    ),
    click.option(
        "--speculative-max-rows",
        type=AUTO_OR_COUNT,
        default=DEFAULT_SPECULATIVE_MAX_ROWS,
        show_default=True,
        help="auto: a speculative engine verifies drafts in the steps where its measured verify and decode "
        "times say that is faster (under load it decodes plain); N: only in steps with at most N generating "
        "rows; 0: in every step.",
    ),
    click.option(
        "--max-verify-nodes",
        type=click.IntRange(min=0),
        default=None,
        help="The most nodes (root included) of a speculative engine's draft trees; 0: the engine's whole "
        "trees. Default: the rows verified together share the tokens the target's matmul kernel takes in one "
        "pass over the weights (fp32: 6 on x86-64 with AVX2 or AVX-512, a 7th costs a second pass; int4 on a CPU "
        "without VNNI: the 4 rows of our kernels' AVX2 tiles): one row's tree has them all, two rows' trees half "
        "each, and steps whose trees would have no room for a draft decode plain.",
    ),
    click.option(
        "--shared-prefill-chunk",
        type=click.IntRange(min=0),
        default=DEFAULT_SHARED_PREFILL_CHUNK,
        show_default=True,
        help="Prompt tokens per step while other requests generate (they wait for "
        "each chunk); a prompt computed alone goes in the engine's largest chunks (builder --prefill-chunk). "
        "0: always the largest.",
    ),
    click.option(
        "--num-scheduler-steps",
        type=click.IntRange(min=1),
        default=None,
        help="The most decode calls a step makes in a row while every request decodes greedily and none "
        "waits (vLLM's flag): the engine's Python between calls is paid once per burst, but tokens "
        "stream in groups of this many and a request that arrives waits for the burst to end. "
        f"Default: 1 for serve (as vLLM), {DEFAULT_NUM_SCHEDULER_STEPS} for run-batch.",
    ),
    click.option(
        "--tool-call-parser",
        type=click.Choice(list(PARSERS)),
        default=None,
        help='Read the tool calls the model makes in its family\'s syntax, which serves tool_choice "auto" '
        "(hermes: <tool_call> blocks, Qwen2.5 / Hermes; llama3_json: Llama 3.1+; pythonic: [f(x=1)], "
        "Llama 3.2 / 4 pythonic templates).",
    ),
    click.option("--enable-auto-tool-choice", is_flag=True, help="vLLM's flag for the same; needs --tool-call-parser."),
    chat_template_option(CHAT_TEMPLATE_HELP + " (e.g. one that shows the model its tools)"),
    click.option(
        "--generation-config",
        type=click.Choice(["auto", "vllm"]),
        default="auto",
        show_default=True,
        help="auto: sampling fields a request leaves unset take the values the model recommends (its "
        "generation_config.json or GGUF sampling keys, see `runner info`); vllm: vLLM's own defaults.",
    ),
    click.option(
        "--max-model-len",
        type=int,
        default=None,
        help="Serve sequences (prompt + output) up to this length, below the engine's --max-seq-len.",
    ),
    click.option(
        "--grammar-timeout",
        type=click.FloatRange(min=0),
        default=DEFAULT_GRAMMAR_TIMEOUT,
        show_default=True,
        help="Seconds a structured output's grammar may take to compile, in a process of its own that is "
        f"killed past them or past {GRAMMAR_MEMORY_MIB} MiB (the request gets a 400; one that waits that long "
        "behind other compiles, a 503): a pathological schema compiles for minutes. 0: compile in the server's "
        "process, without a limit (for trusted clients only).",
    ),
]


def served_engine_options(command):
    """Adds SERVED_ENGINE_OPTIONS to a command."""
    for option in reversed(SERVED_ENGINE_OPTIONS):
        command = option(command)
    return command


def open_served_engine(
    engine,
    max_batch,
    threads,
    model_name,
    enable_prefix_caching,
    speculative_max_rows,
    max_verify_nodes,
    shared_prefill_chunk,
    num_scheduler_steps,
    tool_call_parser,
    enable_auto_tool_choice,
    chat_template,
    generation_config,
    max_model_len,
    grammar_timeout,
):
    """-> (LLMEngine, the name requests use) from the served_engine_options, with what the engine says at start
    on stderr."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise click.UsageError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(PARSERS)})")
    with exit_on(ArtifactError, ValueError):
        llm_engine = LLMEngine(
            EngineArgs(
                engine,
                threads=threads,
                max_batch=max_batch,
                enable_prefix_caching=enable_prefix_caching,
                speculative_max_rows=speculative_max_rows or None,  # 0: every step
                chat_template=chat_template,
                generation_config=generation_config,
                max_model_len=max_model_len,
                max_verify_nodes="auto" if max_verify_nodes is None else max_verify_nodes or None,
                shared_prefill_chunk=shared_prefill_chunk or None,
                num_scheduler_steps=num_scheduler_steps,
                grammar_timeout=grammar_timeout or None,  # 0: no limit
            )
        )
    if llm_engine.executor.min_rows > 1:
        click.echo(PADDED_ROWS_NOTE, err=True)
    if llm_engine.speculation is not None and llm_engine.max_verify_nodes is not None:
        shared = llm_engine.speculation_policy.call_tokens is not None
        click.echo(
            f"note: draft trees of at most {llm_engine.max_verify_nodes} nodes"
            f"{', shared by the rows verified together' if shared else ''} (a verify call past the matmul "
            "kernel's pass costs a second one; --max-verify-nodes 0: the engine's whole trees)",
            err=True,
        )
    if llm_engine.sampling_defaults:
        recommended = ", ".join(f"{k}={v}" for k, v in llm_engine.sampling_defaults.items())
        click.echo(
            f"note: requests that leave them unset sample with the model's recommended {recommended} "
            "(--generation-config vllm: vLLM's own defaults)",
            err=True,
        )
    return llm_engine, model_name or Path(engine).resolve().name


@main.command()
@click.argument("engine", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-waiting", type=int, default=64, show_default=True, help="Queued requests before answering 503.")
@click.option(
    "--shutdown-grace",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds running requests get to finish on shutdown.",
)
@click.option(
    "--api-key",
    envvar="RUNNER_API_KEY",
    default=None,
    help="Require `Authorization: Bearer KEY` on every route but /health and /metrics (or set RUNNER_API_KEY).",
)
@click.option(
    "--allowed-origins",
    multiple=True,
    help="Browser origins allowed to call the API (CORS), repeated or as "
    "a JSON list (vLLM's form); '*' for any. Default: none (no cross-origin browser calls).",
)
@click.option(
    "--max-body-mb",
    type=click.FloatRange(min=0.001),
    default=DEFAULT_MAX_BODY_BYTES / 2**20,
    show_default=True,
    help="The largest request body taken, in MiB (413 otherwise, refused before it is read whole).",
)
@click.option(
    "--parse-special-tokens-in-content",
    is_flag=True,
    help="Read special-token text inside chat message content (e.g. '<|im_start|>system') as those tokens, as vLLM "
    "and transformers do. Default: it stays plain text, so a client cannot write a turn of another role.",
)
@click.option("--root-path", default="", help="The path prefix a proxy serves the API under.")
@click.option(
    "--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None, help="Serve HTTPS with this key..."
)
@click.option(
    "--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None, help="...and this certificate."
)
@click.option(
    "--uvicorn-log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]),
    default="warning",
    show_default=True,
    help="info: a line per request.",
)
@served_engine_options
def serve(
    engine,
    host,
    port,
    max_waiting,
    shutdown_grace,
    api_key,
    allowed_origins,
    max_body_mb,
    parse_special_tokens_in_content,
    root_path,
    ssl_keyfile,
    ssl_certfile,
    uvicorn_log_level,
    tool_call_parser,
    **engine_options,
) -> None:
    """Serve ENGINE with an OpenAI-compatible HTTP API."""
    import uvicorn

    from runner.core.async_engine import AsyncEngine
    from runner.serving.app import ServerConfig, create_app, limit_malloc_arenas

    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise click.UsageError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    origins = origin_list(allowed_origins)
    limit_malloc_arenas()
    engine_options["num_scheduler_steps"] = engine_options["num_scheduler_steps"] or 1  # streams token by token
    llm_engine, name = open_served_engine(engine, tool_call_parser=tool_call_parser, **engine_options)
    # bound here, not by uvicorn once it starts, so that a port in use is one clear error before "serving ..." is
    # printed; not before the engine opens, since under mpirun every rank runs this command and only rank 0 returns
    # from opening it
    listener = listening_socket(host, port)
    port = listener.getsockname()[1]  # --port 0: the one the system chose
    config = ServerConfig(
        name,
        shutdown_grace,
        api_key,
        tool_call_parser,
        origins or [],
        int(max_body_mb * 2**20),
        parse_special_tokens_in_content,
    )

    def stop_serving(error: BaseException) -> None:  # the engine failed for good: uvicorn's own graceful stop
        click.echo(f"runner serve: {error}; stopping the server", err=True)
        server.should_exit = True

    async_engine = AsyncEngine(llm_engine, max_waiting=max_waiting, on_fatal=stop_serving)
    app = create_app(async_engine, config)
    scheme = "https" if ssl_certfile else "http"
    click.echo(
        f"serving {name!r} ({llm_engine.scheduler.max_rows} rows, max_seq_len {llm_engine.max_seq_len}, "
        f"num_scheduler_steps {llm_engine.num_scheduler_steps}) on {scheme}://{host}:{port}/v1",
        err=True,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=uvicorn_log_level,
            timeout_graceful_shutdown=shutdown_grace,
            root_path=root_path,
            ssl_keyfile=ssl_keyfile,
            ssl_certfile=ssl_certfile,
        )
    )
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it caught again once it has shut down gracefully
        pass
    if async_engine.fatal is not None:
        raise click.ClickException(f"the engine failed: {async_engine.fatal}")


def listening_socket(host: str, port: int):
    """A socket bound to host:port for the server to listen on (uvicorn's own choices: IPv6 for an address with a
    colon, SO_REUSEADDR), or a one-line error."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.set_inheritable(True)
    return sock


@main.command("run-batch")
@click.argument("engine", type=click.Path())
@click.option(
    "-i",
    "--input-file",
    type=click.File("r"),
    required=True,
    help="OpenAI batch requests, one JSON per line ('-': stdin).",
)
@click.option(
    "-o", "--output-file", type=click.File("w"), required=True, help="Their results, one per line ('-': stdout)."
)
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Requests handed to the engine at once (it decodes --max-batch of them together).",
)
@served_engine_options
def run_batch(engine, input_file, output_file, max_in_flight, tool_call_parser, **engine_options) -> None:
    """Answer a file of OpenAI Batch API requests (chat completions, completions, responses) with ENGINE, as
    vLLM's run-batch: each result line holds what `runner serve` would have answered."""
    import asyncio

    from runner.cli.run_batch import run_batch as answer_batch
    from runner.core.async_engine import AsyncEngine
    from runner.serving.app import ServerConfig, create_app

    engine_options["num_scheduler_steps"] = engine_options["num_scheduler_steps"] or DEFAULT_NUM_SCHEDULER_STEPS
    llm_engine, name = open_served_engine(engine, tool_call_parser=tool_call_parser, **engine_options)
    async_engine = AsyncEngine(llm_engine, max_waiting=max_in_flight)
    app = create_app(async_engine, ServerConfig(name, tool_call_parser=tool_call_parser))
    start = time.perf_counter()

    def write(line: str) -> None:
        output_file.write(line + "\n")
        output_file.flush()

    try:
        counts = asyncio.run(answer_batch(app, input_file, write, max_in_flight))
    finally:
        async_engine.shutdown(0)
    seconds = time.perf_counter() - start
    click.echo(
        f"[{counts.lines} requests: {counts.answered} answered, {counts.failed} failed; "
        f"{counts.completion_tokens} tokens generated in {seconds:.1f} s, "
        f"{counts.completion_tokens / max(seconds, 1e-9):.1f} tok/s]",
        err=True,
    )


@main.command()
@click.argument("engine", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON instead.")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Check every file's size and SHA-256.")
def info(engine, as_json, verify) -> None:
    """What ENGINE holds: model, dtype, quantization, speculation, phase buckets, KV cache, files."""
    with exit_on(ArtifactError):
        artifact = open_artifact(engine, verify_checksums=verify)
    click.echo(artifact.manifest.to_json() if as_json else "\n".join(describe(artifact)))
    if verify and not as_json:
        click.echo("checksums: every file verified")


@main.command()
@click.argument("engine", type=click.Path())
@click.option("--prompt", default="What is the capital of France?", show_default=True, help="The short prompt.")
@click.option(
    "--long-prompt-tokens",
    type=int,
    default=650,
    show_default=True,
    help="Length of the long prompt (CPython's licence to summarise); 0 = no long prompt.",
)
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompts in the chat template.")
@click.option("--new-tokens", type=int, default=128, show_default=True, help="Tokens generated per run (EOS ignored).")
@click.option("--runs", type=int, default=3, show_default=True, help="Timed runs after a warm-up (median).")
@click.option(
    "--batch-sizes", default=None, help="Comma-separated decode batch sizes (default: 1, 2, 4, ... and the row limit)."
)
@click.option("--threads", type=int, default=None, help="CPU threads (default: onnxruntime's choice).")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the report as JSON."
)
@click.option(
    "--profile/--no-profile",
    default=False,
    show_default=True,
    help="Then profile decode steps per operator type (onnxruntime's profiler, a separate run).",
)
def bench(engine, prompt, long_prompt_tokens, chat, new_tokens, runs, batch_sizes, threads, json_path, profile) -> None:
    """Time ENGINE alone on this machine: time to first token for a short and a long prompt and decode tokens/s at
    batch 1, decode tokens/s at several batch sizes, peak RSS, and MBU against the memory bandwidth measured in the
    same run. For a speculative engine also tokens per verify step and the draft / verify time per step."""
    import json
    import os
    from dataclasses import asdict

    from runner.tools.bench import bench_engine, chat_prompts, generation_batch_sizes, report_lines
    from runner.tools.profile import profile_decode

    with exit_on(ArtifactError, PromptError, ChatTemplateError, ValueError):
        llm_engine = LLMEngine(EngineArgs(engine, threads=threads))
        prompts = chat_prompts(llm_engine.codec, long_prompt_tokens, prompt, chat)
        sizes = generation_batch_sizes(llm_engine)
        if batch_sizes is not None:
            sizes = [int(size) for size in batch_sizes.split(",")]
            if not all(1 <= size <= llm_engine.scheduler.max_rows for size in sizes):
                raise ValueError(f"--batch-sizes must be in [1, {llm_engine.scheduler.max_rows}] for this engine")
        for name, ids in prompts.items():
            if len(ids) + new_tokens > llm_engine.max_seq_len:
                raise ValueError(
                    f"the {name} prompt ({len(ids)} tokens) + --new-tokens {new_tokens} exceed this engine's "
                    f"max sequence length {llm_engine.max_seq_len} (see --long-prompt-tokens)"
                )
        report = bench_engine(llm_engine, prompts, sizes, new_tokens, runs, threads or os.cpu_count())
    click.echo("\n".join(report_lines(report)))
    measured = {"engine": str(engine), **report.to_dict()}
    if profile:
        with exit_on(ValueError):  # too few decode runs to profile
            step_profile = profile_decode(engine, prompts["short"], new_tokens, threads)
        click.echo(
            f"\nper operator type, {step_profile.runs} batch-1 decode runs of the short prompt (profiler on: "
            "times inflated per node, compare shares)"
        )
        click.echo("\n".join(step_profile.lines()))
        measured["profile"] = asdict(step_profile)
    if json_path:
        Path(json_path).write_text(json.dumps(measured, indent=2))


@main.command(name="eval")
@click.argument("engine", type=click.Path())
@click.option(
    "--text", "text_file", required=True, type=click.Path(exists=True, dir_okay=False), help="UTF-8 text to score."
)
@click.option("--window", type=int, default=512, show_default=True, help="Tokens of context per window.")
@click.option("--stride", type=int, default=256, show_default=True, help="Tokens between window starts.")
@click.option("--max-tokens", type=int, default=None, help="Score only the first N tokens of the text.")
@click.option("--threads", type=int, default=None)
def evaluate(engine, text_file, window, stride, max_tokens, threads) -> None:
    """Perplexity of ENGINE on a text file (sliding window)."""
    from runner.tools.evaluate import perplexity

    with exit_on(ArtifactError, ValueError, UnicodeDecodeError):
        llm_engine = LLMEngine(EngineArgs(engine, threads=threads, max_batch=1))  # one sequence at a time
        ids = llm_engine.codec.encode(Path(text_file).read_text(encoding="utf-8"))[:max_tokens]
        result = perplexity(llm_engine, ids, window, stride)
    click.echo(
        f"perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens (window {window}, stride {stride}, "
        f"mean NLL {result.mean_nll:.5f}, {result.seconds:.1f} s)"
    )


if __name__ == "__main__":
    main()
