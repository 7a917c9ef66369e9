"""`specdecode info` and `--json`: the fields a bug report needs, with their types, and the kernel path
decided by the loader's own rule (fast.linear.kernel_plan) for this CPU and, through --cpu-flags, for
others: the AVX2 build (the CPU test_fast.test_kernels_compile_for_avx2_cpus compiles for, -march=haswell),
the eager fallback, AMX. Run in-process: nothing but the kernels (already cached by other tests) is loaded."""
from __future__ import annotations

import json

import pytest

from specdecode.cli import main
from specdecode.fast import linear

HASWELL = "avx avx2 fma f16c bmi1 bmi2 sse4_2"          # -march=haswell: AVX2 + FMA + F16C, no AVX512
SAPPHIRE_RAPIDS = ("avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16")


def info(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["info", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def info_json(capsys, *args: str) -> dict:
    code, out, err = info(capsys, "--json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def simde(tmp_path, monkeypatch):
    """SIMDe headers present (an empty avx512.h is all kernel_plan looks for); nothing is compiled."""
    (tmp_path / "simde" / "x86").mkdir(parents=True)
    (tmp_path / "simde" / "x86" / "avx512.h").write_text("")
    monkeypatch.setenv("SPECDECODE_SIMDE_INCLUDE", str(tmp_path))
    return tmp_path


def test_json_has_every_field_with_its_type(capsys):
    r = info_json(capsys)
    assert isinstance(r["specdecode"]["version"], str) and r["specdecode"]["version"]
    assert isinstance(r["python"], str) and isinstance(r["platform"], str)
    assert isinstance(r["torch"]["version"], str) and r["torch"]["threads"] >= 1
    cpu = r["cpu"]
    assert isinstance(cpu["model"], str) and cpu["logical_cpus"] >= cpu["usable_cpus"] >= 1
    assert cpu["flags_source"] == "/proc/cpuinfo"
    for flag in ("AVX512F", "AVX512-VNNI", "AVX512-BF16", "AMX-TILE", "AMX-INT8", "AMX-BF16", "AVX2", "FMA"):
        assert isinstance(cpu["flags"][flag], bool), flag
    assert cpu["flags"]["AVX2"] == ("avx2" in linear.cpu_flags())
    k = r["kernels"]
    assert k["isa"] in ("avx512", "avx2", "none")
    assert k["path"] in ("avx512-vnni+amx", "avx512-vnni", "avx512-simde", "avx2-simde", "eager")
    for key in ("why", "gguf", "dense_bf16", "dense_fp32", "reason", "cache_dir"):
        assert isinstance(k[key], str) and k[key], key
    assert isinstance(k["amx_bf16"], bool) and isinstance(k["amx_int8"], bool)
    assert k["qamx_min_rows"] > 1
    assert r["threads"]["torch"] == r["torch"]["threads"]
    c = r["cache"]
    assert isinstance(c["dir"], str) and c["bytes"] == sum(c["parts"].values()) >= 0
    assert isinstance(c["models"], list)
    assert set(r["extras"]) >= {"ray", "llama-cpp-python", "llguidance", "openai", "vllm"}
    assert all(v is None or isinstance(v, str) for v in r["extras"].values())
    assert r["extras"]["llguidance"]                       # a dependency: always installed
    assert isinstance(r["env"], dict) and "model" not in r


def test_this_cpu_reports_what_the_loader_loaded(capsys):
    k = info_json(capsys)["kernels"]
    assert k["isa"] == linear.isa()                         # the plan agrees with the library that loaded
    assert k["reason"] == linear.reason()
    assert k["loaded"] is (None if linear.kernel_plan()["isa"] == "none" else linear.available())
    if linear.isa() == "avx512":
        assert k["path"].startswith("avx512-vnni") and "VNNI" in k["gguf"]
        assert k["path"].endswith("+amx") == k["amx_int8"]


def test_text_output_names_the_sections(capsys):
    code, out, err = info(capsys)
    assert code == 0, err
    for word in ("specdecode", "cpu", "flags", "kernels", "GGUF", "dense", "threads", "cache", "extras"):
        assert any(line.lstrip().startswith(word) for line in out.splitlines()), word


def test_avx2_override_reports_the_simde_build(capsys, simde):
    r = info_json(capsys, "--cpu-flags", HASWELL)
    k = r["kernels"]
    assert r["cpu"]["flags_source"] == "--cpu-flags" and r["cpu"]["flags"]["AVX512F"] is False
    assert k["isa"] == "avx2" and k["path"] == "avx2-simde" and k["loaded"] is None
    assert set(k["emulated"]) == {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    assert not k["amx_bf16"] and not k["amx_int8"]
    assert "SIMDe" in k["why"] and str(simde) in k["why"]
    code, out, _ = info(capsys, "--cpu-flags", HASWELL.replace(" ", ","))    # commas work too
    assert code == 0 and "avx2-simde (not loaded" in out and "not this CPU" in out


def test_avx2_without_simde_headers_falls_back_to_eager(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_SIMDE_INCLUDE", str(tmp_path))          # no headers there
    k = info_json(capsys, "--cpu-flags", HASWELL)["kernels"]
    assert k["isa"] == "none" and k["path"] == "eager"
    assert "libsimde-dev" in k["reason"] and k["why"] == k["reason"] and "F.linear" in k["gguf"]


def test_other_cpus_and_switches(capsys, simde, monkeypatch):
    k = info_json(capsys, "--cpu-flags", SAPPHIRE_RAPIDS)["kernels"]
    assert k["path"] == "avx512-vnni+amx" and k["amx_bf16"] and k["amx_int8"] and "AMX int8 tiles" in k["gguf"]
    assert "TDPBF16PS" in k["dense_bf16"]
    zen4 = SAPPHIRE_RAPIDS.replace(" amx_tile amx_int8 amx_bf16", "")
    k = info_json(capsys, "--cpu-flags", zen4)["kernels"]
    assert k["path"] == "avx512-vnni" and not k["amx_bf16"] and "VDPBF16PS" in k["dense_bf16"]
    skylake = zen4.replace(" avx512_vnni avx512_bf16", "")        # AVX-512 without VNNI / BF16: those emulated
    k = info_json(capsys, "--cpu-flags", skylake)["kernels"]
    assert k["isa"] == "avx2" and k["path"] == "avx512-simde" and set(k["emulated"]) == {"avx512_vnni", "avx512_bf16"}
    k = info_json(capsys, "--cpu-flags", "sse2 sse4_2")["kernels"]
    assert k["path"] == "eager" and "lacks avx2, fma, f16c" in k["reason"]
    monkeypatch.setenv("SPECDECODE_QAMX", "0")
    k = info_json(capsys, "--cpu-flags", SAPPHIRE_RAPIDS)["kernels"]
    assert k["path"] == "avx512-vnni" and k["amx_bf16"] and not k["amx_int8"]
    monkeypatch.setenv("SPECDECODE_FAST", "0")
    r = info_json(capsys, "--cpu-flags", SAPPHIRE_RAPIDS)
    assert r["kernels"]["path"] == "eager" and "SPECDECODE_FAST=0" in r["kernels"]["reason"]
    assert r["env"]["SPECDECODE_FAST"] == "0" and r["env"]["SPECDECODE_QAMX"] == "0"


def test_model_option_says_which_path_each_quantization_type_takes(capsys, simde):
    from specdecode.models.config import ModelError
    from specdecode.models.loader import default_model_path
    try:
        path = default_model_path()                          # SmolLM2-135M Q4_1 (+ a Q8_0 tied head)
    except ModelError as exc:
        pytest.skip(str(exc))
    m = info_json(capsys, "--model", str(path), "--cpu-flags", HASWELL)["model"]
    assert m["format"] == "GGUF" and m["architecture"] == "llama" and m["note"] is None
    paths = {g["type"]: g["path"] for g in m["groups"] if g["type"] != "F32"}
    assert paths["Q4_1"].startswith("native (avx2-simde, 16-column layout")
    assert sum(g["tensors"] for g in m["groups"] if g["type"] == "Q4_1") == 30 * 7   # 7 projections per layer
    m = info_json(capsys, "--model", str(path), "--cpu-flags", "sse2")["model"]
    assert all("dequantized" in g["path"] for g in m["groups"] if g["type"] == "Q4_1")
    code, out, _ = info(capsys, "--model", str(path), "--cpu-flags", SAPPHIRE_RAPIDS)
    assert code == 0 and "AMX int8 tiles from" in out


def test_bad_model_is_one_error_naming_the_option(capsys, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (text, tmp_path / "missing.gguf", empty):      # a directory without config.json too
        code, out, err = info(capsys, "--model", str(target))
        assert code == 2 and out == ""
        assert err.startswith("specdecode: error: --model: ") and len(err.strip().splitlines()) == 1
