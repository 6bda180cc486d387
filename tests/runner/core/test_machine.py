"""The machine as results name it: a VM's generic CPU name gets the family, model, vector instructions and L3 size
that tell a Zen 3 from a Zen 5."""

from __future__ import annotations

from runner.core.machine import describe_cpu

ZEN3_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2 bmi2
processor\t: 1
model name\t: something else
"""


def test_a_generic_name_gets_family_model_instructions_and_l3():
    assert describe_cpu(ZEN3_VM, "32768K") == "AMD EPYC (family 25 model 1; AVX2, FMA; L3 32 MiB)"


def test_avx512_and_vnni_are_named_and_an_odd_l3_size_is_kept_as_written():
    zen5 = ZEN3_VM.replace("cpu family\t: 25", "cpu family\t: 26").replace("avx2", "avx2 avx512f avx512_vnni")
    assert describe_cpu(zen5, "1536K") == "AMD EPYC (family 26 model 1; AVX-512, AVX-512 VNNI, AVX2, FMA; L3 1536K)"


def test_an_arm_cpu_and_missing_facts():
    arm = "processor\t: 0\nFeatures\t: fp asimd asimddp sve\nmodel name\t: Neoverse-V1\n"
    assert describe_cpu(arm, None) == "Neoverse-V1 (SVE, NEON dot product, NEON)"
    assert describe_cpu("model name\t: Plain CPU\n", None) == "Plain CPU"
    assert describe_cpu("", "32768K") is None
