"""``options={"offload_activations": ...}`` (issue 32): the activations the forward saves for the backward go to host
memory and come back in the backward (torch's AOTAutograd offloading, on the nodes fxfuse marks).

CPU, Inductor: under HF gradient checkpointing the saved layer inputs are the offloaded ones (the backward graph
receives them as ``cpu_offload_*`` copies), the loss and every gradient equal eager's;
the option's values are checked when given."""
from __future__ import annotations

import pytest
import torch

import fxfuse
from fxfuse.offload import available

from conftest import tiny_causal_lm

pytestmark = pytest.mark.slow  # Inductor compiles a model


@pytest.mark.skipif(not available(), reason="this torch has no activation offloading in AOTAutograd")
def test_checkpointed_layer_inputs_go_to_host_memory_and_gradients_stay_eager():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    names = []

    class Record(CustomGraphPass):  # sees the forward and backward graphs after partitioning
        def __call__(self, graph):
            names.extend(n.name for n in graph.nodes)

        def uuid(self):
            return None

    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(4, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids, labels=ids.clone(), use_cache=False)
    ref.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    hidden = 24 * model.config.hidden_size * 4  # one layer input, fp32
    fn = torch.compile(model, backend="fxfuse", options={"offload_activations": hidden,
                                                         "post_grad_custom_post_pass": Record()})
    out = fn(input_ids=ids, labels=ids.clone(), use_cache=False)
    out.loss.backward()
    assert torch.allclose(out.loss, ref.loss, rtol=1e-6)
    for n, p in model.named_parameters():
        assert (p.grad - want[n]).norm() <= 1e-5 * want[n].norm() + 1e-7, n
    offloaded = {n for n in names if n.startswith("cpu_offload_")}
    # the embedding output (layer 0's input) and layer 1's input: each decoder layer's checkpointed input, which
    # the backward graph now receives as its offloaded copy (on a CPU the copies themselves, CPU to CPU, are
    # no-ops that Inductor removes before its post-grad passes; on CUDA they are the transfers)
    assert len(offloaded) >= model.config.num_hidden_layers, names


@pytest.mark.parametrize("value", [0.5, -1, "yes"])
def test_bad_values_are_refused_when_given(value):
    with pytest.raises(fxfuse.FxFuseOptionsError, match="offload_activations"):
        fxfuse.compile(torch.nn.Linear(2, 2), options={"offload_activations": value})
