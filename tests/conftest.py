"""Shared fixtures: tiny random-init HF models built in-process (nothing is downloaded) and compile helpers."""
from __future__ import annotations

import contextlib
import os

# The caches that hold whole compiled graphs would skip the passes on a hit (and can serve code compiled against an
# older op schema): Inductor's FX graph cache, AOTAutograd's cache, and Dynamo's profile of earlier runs' dynamic
# sizes (which would change what a test compiles). Tests must see the passes run, so these are off, set before torch
# is imported (xdist's workers and the processes tests start inherit them; tests that need a cache undo them).
# What stays on is the kernel cache: a generated C++ kernel compiled once is reused by its source's hash, which the
# same tiny models produce test after test (compiling them again was most of the suite's time on the CPU machines).
# It lives in one fresh directory per test run, which the xdist workers and the processes they start inherit.
for _k in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO"):
    os.environ.setdefault(_k, "0")
if "FXFUSE_TEST_KERNEL_CACHE" not in os.environ:
    import tempfile

    # the run's first process that reads this (pytest itself, or xdist's controller before it starts its workers)
    os.environ["FXFUSE_TEST_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="fxfuse-test-kernels-")
    _KERNEL_CACHE_MADE_HERE = True
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["FXFUSE_TEST_KERNEL_CACHE"]

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # CPU machines test the Triton kernels themselves through the interpreter (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Threads per test process: the cores shared among pytest-xdist's workers (README's test command runs two).
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import fxfuse

    torch._dynamo.reset()
    fxfuse.clear_reports()
    yield
    torch._dynamo.reset()
    _reset_accelerate_state()


@pytest.fixture
def verify_rewrites(monkeypatch):
    """Compiles in the test run fxfuse's numeric verification (``FXFUSE_VERIFY=1``, read when options are parsed):
    each pass's outputs and gradients are compared with the unfused graph's on the first real inputs, and a pass
    that changes the numbers is rolled back, so a test that asserts a fusion also proves it kept the numbers.
    The model-test files use it for all their tests (``pytestmark``)."""
    monkeypatch.setenv("FXFUSE_VERIFY", "1")


def _reset_accelerate_state():
    """Trainers leave accelerate's process-wide singletons (AcceleratorState, GradientState) behind; reset them so
    each test's trainer starts from a clean state."""
    import sys

    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def tiny_causal_lm(arch: str = "llama", **overrides):
    """A 2-layer random-init causal LM of the given family, small enough to compile in seconds."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    for key in list(overrides):  # size overrides go into the constructor (derived fields follow them)
        if key in common:
            common[key] = overrides.pop(key)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(**common, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
        cls = tf.Gemma2ForCausalLM
    elif arch == "gemma":
        cfg = tf.GemmaConfig(**common, head_dim=8)
        cls = tf.GemmaForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=8)
        cls = tf.Qwen3ForCausalLM
    elif arch == "phi3":
        cfg = tf.Phi3Config(**{**common, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
        cls = tf.Phi3ForCausalLM
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"])
        cls = tf.Gemma3ForCausalLM
    elif arch == "llama4":  # dense Llama-4 text: layer 0 chunked attention with RoPE, layer 1 full without (NoPE)
        cfg = tf.Llama4TextConfig(**common, head_dim=8, intermediate_size_mlp=64, attention_chunk_size=8,
                                  interleave_moe_layer_step=1, moe_layers=[], no_rope_layers=[1, 0])
        cls = tf.Llama4ForCausalLM
    else:
        raise ValueError(arch)
    attn = overrides.pop("attn_implementation", "eager")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    if hasattr(cfg, "_attn_implementation"):
        cfg._attn_implementation = attn
    return cls(cfg)


def fused_sites(pass_name, rep=None):
    """The sites ``pass_name`` fused in ``rep`` (default: the latest fusion report)."""
    import fxfuse

    rep = rep or fxfuse.report()
    return [r for r in rep.fused if r.pass_name == pass_name]


def skipped_sites(pass_name, rep=None):
    """The sites ``pass_name`` left to Inductor (with their reasons) in ``rep`` (default: the latest report)."""
    import fxfuse

    rep = rep or fxfuse.report()
    return [r for r in rep.skipped if r.pass_name == pass_name]


@contextlib.contextmanager
def saved_activation_bytes():
    """Inside the block, count the bytes autograd saves for the backward (saved-tensor hooks), parameters not
    counted; yields a one-element list that holds the total when the block ends."""
    total = [0]

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(model, ref, rtol=1e-4, atol=1e-5):
    got = grads_of(model)
    assert set(got) == set(ref), set(got) ^ set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=rtol, atol=atol, msg=lambda m: f"grad of {n}: {m}")


@pytest.fixture
def inductor_config_patches(monkeypatch):
    """The Inductor config patches every ``compile_fx`` call received (mode and options forwarded by fxfuse), one
    dict gathering them; Inductor still compiles."""
    import torch._inductor.compile_fx as cfx

    seen = {}
    real = cfx.compile_fx

    def spy(gm, ex, config_patches=None, **kw):
        seen.update(config_patches or {})
        return real(gm, ex, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    return seen


def pytest_unconfigure(config):
    if globals().get("_KERNEL_CACHE_MADE_HERE"):  # the process that made it (xdist's workers are gone by now)
        import shutil

        shutil.rmtree(os.environ["FXFUSE_TEST_KERNEL_CACHE"], ignore_errors=True)
