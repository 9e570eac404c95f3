"""A transfer writes without an undo snapshot of what cannot fail, and still changes nothing when
a write fails (issue 45: copy throughput).

Once every check has passed (shapes, dtypes, NaN/Inf, completeness), the writes that are plain
in-place copies (torch tensors of one shape on one device, dst neither an inference tensor nor
self-overlapping: ``backends/torch/_params.in_place_copies``) are done last, all in one
``torch._foreach_copy_``, with no copy of dst taken first; every other write keeps its undo.
These tests make writes fail through torch's own refusals (an inference tensor updated outside
inference mode, a tensor whose elements share memory) after other writes were made, and check
that dst is left exactly as it was. Real transformers models, tiny random configs.
"""
from __future__ import annotations

import pytest

import dense_bridge as db

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class Ops(TorchDispatchMode):
    """The aten ops a transfer runs, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _llama(seed: int, layers: int = 3):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2(seed: int):
    """GPT-2's Conv1D layers are linear layers read through a layout declaration: their writes are
    not plain copies (they keep their undo) and come before the plain ones."""
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before: dict) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed by a failed transfer"


def _swap(module, name: str, tensor) -> None:
    """Replace ``module``'s parameter ``name`` by ``tensor`` (a Parameter without grad)."""
    delattr(module, name)
    module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))


def test_a_plain_transfer_takes_no_snapshot_and_copies_everything():
    a, b = _llama(0), _llama(1)
    with Ops() as ops:
        report = db.transfer(a, b)
    assert ops.ops.get("clone", 0) == 0 and ops.ops.get("_foreach_copy_") == 1, ops.ops
    assert report.not_moved_dst == []
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k


@pytest.mark.parametrize("make", ["llama", "gpt2"])
def test_an_inference_tensor_in_dst_fails_the_write_and_nothing_changes(make):
    """torch refuses an in-place update of an inference tensor outside inference mode: a write that
    fails after the checks passed. In GPT-2 the Conv1D layers before it were written (with their
    undo) when it fails; the plain copies were not made yet."""
    build = _llama if make == "llama" else _gpt2
    a, b = build(0), build(1)
    for model, seed in ((a, 0), (b, 1)):  # a persistent buffer (state a transfer moves) in a late layer
        norm = model.model.layers[2].post_attention_layernorm if make == "llama" else model.transformer.h[2].ln_2
        torch.manual_seed(seed)
        norm.register_buffer("stat", torch.randn(32))
    with torch.inference_mode():
        frozen = torch.randn(32)
    norm.register_buffer("stat", frozen)
    before = _state(b)
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        db.transfer(a, b)
    _assert_unchanged(b, before)
    assert not torch.equal(a.state_dict()[next(iter(before))], b.state_dict()[next(iter(before))])


def test_a_self_overlapping_dst_tensor_fails_the_write_and_nothing_changes():
    """An expanded tensor (every element one memory location): torch refuses to write into it."""
    a, b = _gpt2(0), _gpt2(1)
    ln = b.transformer.h[1].ln_1
    _swap(ln, "bias", torch.zeros(1).expand(32))
    before = _state(b)
    with pytest.raises(RuntimeError, match="single memory location"):
        db.transfer(a, b)
    _assert_unchanged(b, before)


def test_the_in_place_verb_leaves_out_every_copy_that_could_fail():
    """``in_place_copies`` takes only what cannot fail: not an inference tensor, not a
    self-overlapping one, not another shape or a source that is no tensor, not a copy reading
    memory another one writes."""
    from dense_bridge.backends.torch import in_place_copies

    lin = torch.nn.Linear(4, 3)
    src = {"kernel": torch.randn(4, 3), "bias": torch.randn(3)}
    taken, commit = in_place_copies([(lin, "canonical", src)])
    assert taken == [0]
    commit()
    assert torch.equal(lin.weight, src["kernel"].t()) and torch.equal(lin.bias, src["bias"])

    norm = torch.nn.LayerNorm(3)
    with torch.inference_mode():
        frozen = torch.ones(3)
    norm.register_buffer("stat", frozen)
    assert in_place_copies([(norm, "native", {"stat": torch.randn(3)})]) == ([], None)
    _swap(norm, "weight", torch.zeros(1).expand(3))
    assert in_place_copies([(norm, "native", {"weight": torch.randn(3)})]) == ([], None)
    assert in_place_copies([(lin, "native", {"bias": torch.randn(4)})]) == ([], None)  # shape
    assert in_place_copies([(lin, "native", {"bias": [1.0, 2.0, 3.0]})]) == ([], None)  # no tensor
    assert in_place_copies([(lin, "lora", src)]) == ([], None)  # a form it does not know
    other = torch.nn.Linear(4, 3)  # src reads lin's memory while lin is written: one by one instead
    assert in_place_copies([(lin, "canonical", {"kernel": other.weight.detach().t()}),
                            (other, "native", {"weight": lin.weight.detach()})]) == ([], None)


def test_large_finite_values_pass_the_nonfinite_test_and_move():
    """The NaN/Inf screen sums squares: values whose squares overflow float32 are judged again
    exactly (max-abs) and move; a real Inf is still refused."""
    a, b = _llama(0, layers=1), _llama(1, layers=1)
    with torch.no_grad():
        a.model.layers[0].mlp.up_proj.weight[0, 0] = 3e38
        a.model.norm.weight[1] = -1e30
    db.transfer(a, b)
    assert b.model.layers[0].mlp.up_proj.weight[0, 0].item() == pytest.approx(3e38)
    assert b.model.norm.weight[1].item() == pytest.approx(-1e30)
    with torch.no_grad():
        a.model.norm.weight[2] = float("-inf")
    before = _state(b)
    with pytest.raises(db.ConversionError, match="'model.norm.weight' holds NaN or Inf"):
        db.transfer(a, b)
    _assert_unchanged(b, before)


def test_a_widening_transfer_copies_in_place_with_the_cast():
    """bfloat16 into float32 (exact): the plain copies cast as they copy, in the same one call."""
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    b = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    with Ops() as ops:
        db.transfer(a, b)
    assert ops.ops.get("_foreach_copy_") == 1 and ops.ops.get("clone", 0) == 0, ops.ops
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert y.dtype == torch.float32 and torch.equal(x.float(), y), k
