"""Options check themselves when given (did-you-mean, declared pass options), ``fxfuse.compile`` raises at the
call, and ``fxfuse.install()`` makes Inductor itself run fxfuse (HF Trainer's ``torch_compile=True``)."""
from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse import registry
from fxfuse.pass_context import PassContext
from fxfuse.errors import FxFuseOptionsError, PassRegistrationError
from fxfuse.options import FxFuseOptions
from fxfuse.report import FusionReport

from _trainer_utils import make_texts, make_tokenizer, train_args
from conftest import tiny_causal_lm

AOT = {"compiler": "aot_eager"}
LCE = "linear_cross_entropy"


# -- FxFuseOptions.parse ----------------------------------------------------------------------------------------
BAD = [
    ({"strcit": True}, r"unknown option 'strcit'; did you mean 'strict'\?"),
    ({"strict": "false"}, r"options\['strict'\] must be True or False, got 'false' \(a str\)"),
    ({"verify": 1}, r"options\['verify'\] must be True or False, got 1 \(an int\)"),
    ({"max_autotun": True}, r"did you mean 'max_autotune'\?"),
    ({"compiler": "indcutor"}, r"options\['compiler'\] must be one of 'auto', 'inductor', 'aot_eager'.*did you "
                               r"mean 'inductor'"),
    ({"passes": {"lora_linar": False}}, r"unknown pass 'lora_linar'; did you mean 'lora_linear'\?"),
    ({"passes": ["sdpa_causal_msk"]}, r"did you mean 'sdpa_causal_mask'\?"),
    ({"passes": {"lora_linear": 0}}, r"options\['passes'\]\['lora_linear'\] must be True or False, got 0"),
    ({"passes": "lora_linear"}, r"write \['lora_linear'\] to run only that pass"),
    ({"pass_options": {"lce": {"logits": "lazy"}}}, r"pass_options\['lce'\]: unknown pass 'lce'; did you mean "
                                                     r"'linear_cross_entropy'\?"),
    ({"pass_options": {LCE: {"chunk_byte": 1 << 20}}}, r"unknown option 'chunk_byte'; did you mean 'chunk_bytes'\? "
                                                       r"linear_cross_entropy's options: logits, chunk_bytes"),
    ({"pass_options": {LCE: {"logits": "materialise"}}}, r"\['logits'\] must be one of 'lazy', 'materialize', got "
                                                         r"'materialise' \(a str\); did you mean 'materialize'\?"),
    ({"pass_options": {LCE: {"chunk_bytes": "1GB"}}}, r"\['chunk_bytes'\] must be an int >= 0 .*got '1GB' \(a str\); "
                                                      r"write 1 << 30 for 1 GiB"),
    ({"pass_options": {LCE: {"chunk_bytes": -1}}}, r"must be an int >= 0"),
    ({"pass_options": {LCE: {"chunk_bytes": 2.5e8}}}, r"must be an int >= 0"),
    ({"pass_options": {"linear_log_probs": {"logits": "lazy"}}}, r"unknown option 'logits'.*linear_log_probs's "
                                                                 r"options: chunk_bytes"),
    ({"pass_options": {"lora_linear": {"mixed_dtype": "fp32"}}}, r"must be one of 'base', 'skip'"),
    ({"pass_options": {"lora_horizontal": {"max_group": 1}}}, r"\['max_group'\] must be an int >= 2"),
    ({"pass_options": {"lora_horizontal": {"max_group": True}}}, r"must be an int >= 2 .*got True \(a bool\)"),
    ({"pass_options": {"sdpa_causal_mask": {"max_mask_elements": 0}}}, r"must be an int >= 1"),
    ({"pass_options": {"sdpa_attention": {"x": 1}}}, r"unknown option 'x'; sdpa_attention's options: kernel"),
    ({"pass_options": {"softcap_attention": {"kernel": "cudnn"}}}, r"kernel.*one of.*'auto', 'fxfuse', 'sdpa'"),
    ({"pass_options": {LCE: "materialize"}}, r"pass_options\['linear_cross_entropy'\] must be a dict"),
    ({"extra_passes": ["not callable"]}, r"extra_passes.*callables"),
    ({"debug_dir": 3}, r"debug_dir.*path"),
]


@pytest.mark.parametrize("options,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_options_are_named_with_a_suggestion(options, message):
    with pytest.raises(FxFuseOptionsError, match=message) as ei:
        FxFuseOptions.parse(options)
    assert isinstance(ei.value, fxfuse.FxFuseError)
    assert len(str(ei.value)) < 400, str(ei.value)  # short and plain


def test_good_options_parse_and_none_means_the_declared_default():
    opts = FxFuseOptions.parse({"strict": True, "passes": {"lora_linear": False}, "epilogue_fusion": False,
                                "pass_options": {LCE: {"logits": "materialize", "chunk_bytes": None},
                                                 "lora_horizontal": {"max_group": 3}, "sdpa_attention": None}})
    assert opts.strict is True and opts.inductor == {"epilogue_fusion": False}
    assert opts.pass_options == {LCE: {"logits": "materialize"}, "lora_horizontal": {"max_group": 3}}
    assert FxFuseOptions.parse({"pass_options": {LCE: {"chunk_bytes": 1 << 30}}}).pass_options[LCE] == \
        {"chunk_bytes": 1 << 30}


def _options_read_by(spec) -> set:
    """Option names a pass module's source reads through the context (``chunk_bytes_option`` is the lm-head
    passes' shared reader of ``chunk_bytes``)."""
    src = inspect.getsource(inspect.getmodule(spec.fn))
    names = set(re.findall(r"ctx\.(?:pass_option|int_option|choice_option)\(\s*[\"'](\w+)[\"']", src))
    if "chunk_bytes_option(ctx)" in src:
        names.add("chunk_bytes")
    return names


def test_every_builtin_pass_declares_exactly_the_options_it_reads():
    builtins = [s for s in registry.registered_passes() if s.module.startswith("fxfuse.passes")]
    assert len(builtins) >= 7
    for spec in builtins:
        assert set(spec.options) == _options_read_by(spec), spec.name
        for name, opt in spec.options.items():
            assert opt.doc and opt.default is not None and opt.check(opt.default) is None, (spec.name, name)


def test_pass_context_helpers_read_declared_defaults():
    ctx = PassContext(FusionReport("t"), FxFuseOptions(), None, pass_name="lora_horizontal")
    assert ctx.int_option("max_group") == 8 and ctx.pass_option("max_group") == 8
    ctx.pass_name = "lora_linear"
    assert ctx.choice_option("mixed_dtype") == "base"
    ctx.pass_name = LCE
    assert ctx.pass_option("logits", "lazy") == "lazy" and ctx.int_option("chunk_bytes", 0, 0) == 0
    # options built by hand (not parsed) are still checked where a pass reads them: the pass rolls back
    ctx.options = FxFuseOptions(pass_options={LCE: {"chunk_bytes": "big"}})
    with pytest.raises(fxfuse.FxFusePassError, match="chunk_bytes"):
        ctx.int_option("chunk_bytes", 0, 0)


def test_register_pass_checks_option_specs():
    saved = dict(registry._REGISTRY), dict(registry._MODULE_OF_PASS)
    try:
        with pytest.raises(PassRegistrationError, match="unknown spec field"):
            registry.register_pass("t_opts_a", order=1, description="t", options={"n": {"typ": int}})
        with pytest.raises(PassRegistrationError, match="default 0 is not a valid value"):
            registry.register_pass("t_opts_b", order=1, description="t", options={"n": {"type": int, "minimum": 1,
                                                                                          "default": 0}})

        @registry.register_pass("t_opts_c", order=1, description="t",
                                options={"mode": {"choices": ("a", "b"), "default": "a", "doc": "d"}})
        def run(gm, ctx):
            return 0

        assert registry.get_pass("t_opts_c").options["mode"].type is str
        with pytest.raises(FxFuseOptionsError, match="did you mean 'b'"):
            FxFuseOptions.parse({"pass_options": {"t_opts_c": {"mode": "B"}}})
    finally:
        registry._REGISTRY.clear(); registry._REGISTRY.update(saved[0])
        registry._MODULE_OF_PASS.clear(); registry._MODULE_OF_PASS.update(saved[1])


def test_torch_compile_reports_a_bad_option_as_fxfuse_error_at_first_call():
    m = nn.Linear(4, 4)
    fn = torch.compile(m, backend="fxfuse", options={**AOT, "pass_options": {LCE: {"chunk_bytes": "1GB"}}})
    with pytest.raises(FxFuseOptionsError, match="write 1 << 30"):
        fn(torch.randn(2, 4))


# -- fxfuse.compile ---------------------------------------------------------------------------------------------
def test_compile_raises_at_the_call_not_at_the_first_forward():
    m = nn.Linear(4, 4)
    with pytest.raises(FxFuseOptionsError, match="did you mean 'strict'"):
        fxfuse.compile(m, strcit=True)
    with pytest.raises(FxFuseOptionsError, match="did you mean 'strict'"):
        fxfuse.compile(m, options={"strcit": True})
    with pytest.raises(FxFuseOptionsError, match="did you mean 'materialize'"):
        fxfuse.compile(m, pass_options={LCE: {"logits": "materialise"}})
    with pytest.raises(FxFuseOptionsError, match="did you mean 'max-autotune'"):
        fxfuse.compile(m, mode="max-autotun")
    with pytest.raises(FxFuseOptionsError, match="given twice"):
        fxfuse.compile(m, options={"strict": True}, strict=False)
    with pytest.raises(FxFuseOptionsError, match="backend='fxfuse'"):
        fxfuse.compile(m, backend="inductor")
    assert not fxfuse.reports()  # nothing was compiled


@pytest.mark.slow
def test_compile_merges_keyword_options_and_runs_the_passes():
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 12))
    ref = model(input_ids=ids, labels=ids)
    compiled = fxfuse.compile(model, strict=True, compiler="aot_eager", pass_options={LCE: {"logits": "materialize"}})
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    out = compiled(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert type(out.logits) is torch.Tensor  # materialize reached the pass (lazy logits are a subclass)
    assert [r for r in fxfuse.report().fused if r.pass_name == LCE]


def test_compile_with_mode_and_options_folds_the_mode_into_options(inductor_config_patches):
    seen = inductor_config_patches
    calls = []
    fxfuse.compile(lambda x: x * 2, mode="max-autotune-no-cudagraphs", passes=[],
                   extra_passes=[lambda gm: calls.append(1) or 0])(torch.randn(3))
    assert seen.get("max_autotune") is True and calls == [1]

    @fxfuse.compile(compiler="aot_eager")
    def f(x):
        return x + 1

    assert torch.equal(f(torch.zeros(2)), torch.ones(2))


# -- fxfuse.install ---------------------------------------------------------------------------------------------
@pytest.fixture
def clean_hook():
    import torch._inductor.config as ic

    before, post_before = ic.pre_grad_custom_pass, ic.post_grad_custom_post_pass
    yield ic
    fxfuse.uninstall()
    ic.pre_grad_custom_pass = before
    ic.post_grad_custom_post_pass = post_before


def test_install_checks_options_and_refuses_what_inductor_cannot_do(clean_hook):
    with pytest.raises(FxFuseOptionsError, match="lazy logits"):
        fxfuse.install(pass_options={LCE: {"logits": "lazy"}})
    with pytest.raises(FxFuseOptionsError, match="did you mean 'strict'"):
        fxfuse.install(strcit=True)
    with pytest.raises(FxFuseOptionsError, match=r"fxfuse.install\(\): 'strict' given twice"):
        fxfuse.install(options={"strict": True}, strict=False)
    with pytest.raises(FxFuseOptionsError, match="'compiler' does not apply"):
        fxfuse.install(compiler="aot_eager")
    with pytest.raises(FxFuseOptionsError, match="Inductor's settings"):
        fxfuse.install(epilogue_fusion=False)
    with clean_hook.patch(use_pre_grad_passes=False):
        with pytest.raises(fxfuse.FxFuseError, match="use_pre_grad_passes = False"):
            fxfuse.install()
    assert clean_hook.pre_grad_custom_pass is None or not fxfuse.inductor_hook.installed()


def test_install_composes_with_a_users_pre_grad_pass(clean_hook):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "user-pass"

    mine = UserPass()
    clean_hook.pre_grad_custom_pass = mine
    with fxfuse.install(passes=[]) as inst:
        assert clean_hook.pre_grad_custom_pass == [mine, inst.hook]
        assert fxfuse.inductor_hook.installed()
        from fxfuse.pass_manager import source_hash

        key = inst.hook.uuid()
        assert key[:3] == ("fxfuse-pre-grad", "fxfuse", source_hash())
        # pickled as its key (an Inductor that hashes its pickled config for the graph cache, as torch 2.11 does,
        # could not pickle a class made in a function: every such graph skipped the cache)
        import pickle

        assert pickle.loads(pickle.dumps(inst.hook)) == key
        fxfuse.install(passes=["lora_linear"])  # other options: another key, so no cache hit across them
        assert inst.hook.uuid() != key and pickle.loads(pickle.dumps(inst.hook)) == inst.hook.uuid()
        assert pickle.dumps(clean_hook.post_grad_custom_post_pass)  # the post-grad fold install() adds
        fxfuse.install(passes=[], strict=True)  # again: new options, same place
        assert clean_hook.pre_grad_custom_pass == [mine, inst.hook] and inst.hook.opts.strict
        torch.compile(lambda x: torch.sin(x) * 2)(torch.randn(8))
    assert seen, "the user's pass did not run"
    assert clean_hook.pre_grad_custom_pass is mine  # exactly what the user had
    assert clean_hook.post_grad_custom_post_pass is None  # the post-grad fold install() added is gone too
    assert not fxfuse.uninstall()


def test_backend_fxfuse_under_install_runs_the_passes_once(clean_hook):
    fxfuse.install()
    x = torch.randn(6, 8, requires_grad=True)
    W = torch.randn(16, 8, requires_grad=True)
    y = torch.randint(0, 16, (6,))
    fxfuse.compile(lambda x, W, y: torch.nn.functional.cross_entropy(x @ W.T, y))(x, W, y).backward()
    assert len(fxfuse.reports()) == 1, [str(r) for r in fxfuse.reports()]
    assert [r for r in fxfuse.report().fused if r.pass_name == LCE]


def _trainer_losses(tmp_path, tag, compile_it):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    tok = make_tokenizer(64)
    ds = Dataset.from_dict({"text": make_texts(12, vocab_size=64)}).map(lambda b: tok(b["text"]), batched=True,
                                                                       remove_columns=["text"])
    args = TrainingArguments(output_dir=str(tmp_path / tag), torch_compile=compile_it, **train_args(max_steps=2))
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
def test_hf_trainer_torch_compile_runs_fxfuse_after_install(tmp_path, clean_hook):
    """``TrainingArguments(torch_compile=True)``: accelerate compiles with Inductor, which now runs fxfuse's
    passes; the losses equal an uncompiled run's."""
    ref = _trainer_losses(tmp_path, "eager", False)
    torch._dynamo.reset()
    fxfuse.clear_reports()
    with fxfuse.install():
        got = _trainer_losses(tmp_path, "compiled", True)
    assert not fxfuse.inductor_hook.installed()
    assert len(ref) == 2 and got == pytest.approx(ref, rel=1e-4), (got, ref)
    fused = [s for r in fxfuse.reports() for s in r.fused]
    assert any(s.pass_name == LCE for s in fused), [str(r) for r in fxfuse.reports()]
    assert not [s for r in fxfuse.reports() for s in r.rolled_back], [str(r) for r in fxfuse.reports()]
