"""The command line (``python -m fxfuse``: demo, report, doctor; ``fxfuse-demo``) and report locations written as
the user writes module paths."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import fxfuse
from fxfuse.__main__ import COMMANDS, _main
from fxfuse.errors import module_path, node_location

from conftest import tiny_causal_lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_m_fxfuse(*args):
    return subprocess.run([sys.executable, "-m", "fxfuse", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


@pytest.mark.slow
def test_help_lists_every_subcommand_and_unknown_is_a_usage_error():
    r = _python_m_fxfuse("--help")
    assert r.returncode == 0, r.stderr
    for name in ("demo", "report", "doctor"):
        line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 20, line  # a one-line description
    r = _python_m_fxfuse("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr and "usage:" in r.stderr
    assert len(r.stderr.splitlines()) <= 3


def test_no_subcommand_prints_usage(capsys):
    assert _main([]) == 2
    assert "usage: python -m fxfuse {demo,report,doctor}" in capsys.readouterr().err


def test_fxfuse_demo_console_script_runs_the_demo_without_a_subcommand(monkeypatch):
    import importlib

    try:
        import tomllib
    except ImportError:  # python < 3.11
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["fxfuse-demo"]
    mod, fn = target.split(":")
    entry = getattr(importlib.import_module(mod), fn)
    seen = []
    monkeypatch.setattr("fxfuse.demo.main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(sys, "argv", ["fxfuse-demo", "--steps", "3"])
    assert entry() == 0 and seen == [["--steps", "3"]]


def test_report_prints_the_saved_reports(tmp_path, capsys):
    W = torch.randn(16, 8, requires_grad=True)
    fn = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(x @ W.T, y), backend="fxfuse",
                       options={"compiler": "aot_eager", "debug_dir": str(tmp_path)})
    fn(torch.randn(6, 8), torch.randint(0, 16, (6,))).backward()
    fn(torch.randn(9, 8), torch.randint(0, 16, (9,))).backward()  # a second graph (the dynamic-length recompile)
    assert _main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ".report.txt" in out and "[fused] linear_cross_entropy" in out and "fxfuse graph" in out
    # the run first, as fxfuse.report() prints it: both graphs' sites counted by pass
    assert out.startswith(fxfuse.report().summary().split(";")[0]), out
    assert "fxfuse run: 2 graphs compiled: 2 fused" in out and "linear_cross_entropy: 2 fused" in out, out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _main(["report", str(empty)]) == 1
    assert "no *.report.txt" in capsys.readouterr().err


def test_doctor_lists_versions_device_and_every_fused_op(capsys):
    assert _main(["doctor"]) == 0
    out = capsys.readouterr().out
    for what in ("python", "torch", "triton", "transformers", "peft", "trl", "fxfuse"):
        assert any(ln.split()[:1] == [what] for ln in out.splitlines()), what
    assert ("no GPU" in out) != torch.cuda.is_available()
    assert "Triton runs" in out
    for op in fxfuse.ops.__all__:
        line = next(ln for ln in out.splitlines() if f"fxfuse.ops.{op} " in ln)
        assert "GPU: Triton:" in line and "CPU: yes" in line, line
    assert "max_group=8" in out  # the passes with their declared options
    # a default that stands for the op's own default is shown as what it means (the code's value, not a bare 0)
    from fxfuse.kernels import lm_head_rows
    assert f"chunk_bytes=0 = {lm_head_rows.DEFAULT_CHUNK_BYTES >> 20} MiB" in out


@pytest.mark.slow
def test_demo_runs_shows_curves_fusions_and_no_warnings_of_its_own(tmp_path, capsys):
    png = tmp_path / "curves.png"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = COMMANDS["demo"][1](["--steps", "3", "--compiler", "aot_eager", "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0 and "losses match: yes" in out
    assert out.count("fxfuse   step") == 3  # one progress line per step
    assert "F = fxfuse" in out and "|" in out  # the text plot
    assert "sdpa_causal_mask" in out and "rewrite, not a fusion" in out
    assert "fusion -> fxfuse::linear_cross_entropy" in out and "memory saved" in out
    try:
        import matplotlib  # noqa: F401

        assert png.exists() and f"loss curves saved to {png}" in out
    except ImportError:
        assert "matplotlib is not installed" in out
    demo_file = os.path.join(ROOT, "fxfuse", "demo.py")
    ours = [w for w in caught if "dynamo_pgo" in str(w.message) or os.path.abspath(w.filename) == demo_file]
    assert not ours, [str(w.message) for w in ours]


# -- report locations -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dynamo,user", [
    ("L['self'].__dict__['_modules']['model'].__dict__['_modules']['layers'].__dict__['_modules']['0']",
     "model.layers.0"),
    ("L['self'].model.layers[0].self_attn", "model.layers.0.self_attn"),
    ("L['model'].layers.1", "model.layers.1"),
    ("getattr(L['self'].model, 'lm_head')", "model.lm_head"),
    ("L['self']", ""),
])
def test_module_path_is_written_as_the_user_writes_it(dynamo, user):
    assert module_path(dynamo) == user


@pytest.mark.slow
def test_peft_lora_site_location_reads_as_the_models_own_path():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_causal_lm("llama"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                              target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 128, (2, 8))
    torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager"})(input_ids=ids, labels=ids)
    sites = [s for s in fxfuse.report().fused if s.pass_name == "lora_linear"]
    assert sites, str(fxfuse.report())
    locs = [s.location for s in sites]
    assert any("module model.layers.0.self_attn.q_proj (lora.Linear)" in loc for loc in locs), locs
    for loc in locs:
        module = loc.split("; module ")[-1]  # the source line before it is PEFT's own code, as today
        assert module.startswith("model.layers.") and "base_layer" not in module, loc
        assert "L['self']" not in loc and "__dict__" not in loc and "base_model" not in loc, loc


def test_node_location_without_peft_wrappers_keeps_the_path():
    class N:
        meta = {"nn_module_stack": {"a": ("L['self'].model", torch.nn.Module),
                                    "b": ("L['self'].model.base_model.model.x", torch.nn.Linear)}}

    # base_model.model not at the start: not PEFT's wrapper, kept as it is
    assert node_location(N()) == "module model.base_model.model.x (Linear)"
