"""The exact route's build, recorded on the meta device and replayed op by op (``lightning_3d.parallel.init_tape``),
gives the weights of the model built as written, bit for bit, and holds only the tensors being initialized.

Models from transformers built from tiny configs and models written elsewhere (helpers/user_models.py), each
built once eagerly on the host and once recorded then replayed, from the same random state."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.user_models import NanoGPT
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.parallel.init_tape import InitTape, OnMeta

transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def hf(config_class, model_class, **sizes):
    return lambda: model_class(config_class(**sizes))


class WithData(nn.Module):
    """A buffer from Python data (``torch.tensor``), a padding row zeroed after the draw, a scaled copy."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, padding_idx=0)
        self.register_buffer("table", torch.tensor([1.0, 2.0, 3.0]))
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(0.5).add_(self.emb.weight[:8])
            self.proj.bias.copy_(torch.randn(8) * 0.1)


BUILDS = {
    "nanogpt": lambda: NanoGPT(64, 16, 3, 32, 4),  # apply(_init_weights), scaled c_proj, tied head
    "reference_gpt": lambda: GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=32, n_head=4)),
    "llama": hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, **SMALL),
    "llama_tied": hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, **SMALL, tie_word_embeddings=True),
    "gpt2": hf(transformers.GPT2Config, transformers.GPT2LMHeadModel, vocab_size=64, n_positions=16, n_embd=32,
               n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    "phi3": hf(transformers.Phi3Config, transformers.Phi3ForCausalLM, **SMALL, pad_token_id=0, eos_token_id=1),
    "bert": hf(transformers.BertConfig, transformers.BertForMaskedLM, vocab_size=64, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gemma2": hf(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, **SMALL, head_dim=8),
    "qwen2": hf(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, **SMALL),
    "python_data_and_partial_writes": WithData,
}


def tensors_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def record(build, rng_state) -> InitTape:
    tape = InitTape(rng_state)
    with OnMeta(), tape:
        model = build()
    tape.finish(model)
    return tape


@pytest.mark.parametrize("name", BUILDS)
def test_the_replayed_build_equals_the_build_as_written_bit_for_bit(name):
    torch.manual_seed(3)
    start = torch.get_rng_state()
    eager = tensors_of(BUILDS[name]())
    after_eager = torch.get_rng_state()
    torch.manual_seed(11)  # the replay starts from the state it was given, not from the current one
    tape = record(BUILDS[name], start)
    assert tape.problem is None, tape.problem
    order = tape.order()
    assert sorted(n for names in order for n in names) == sorted(eager)  # every tensor once, tied ones together
    got = {}
    for (names, tensor), expected in zip(tape.tensors(), order, strict=True):
        assert names == expected
        got.update({n: tensor.clone() for n in names})
    mismatched = [n for n, t in eager.items() if not (t.dtype == got[n].dtype and torch.equal(t, got[n]))]
    assert not mismatched
    assert torch.equal(torch.get_rng_state(), after_eager)  # dropout after set-up draws as one process's


def test_the_replay_follows_the_default_dtype_the_build_ran_under():
    build = BUILDS["llama"]
    torch.manual_seed(3)
    start = torch.get_rng_state()
    torch.set_default_dtype(torch.bfloat16)
    try:
        eager = tensors_of(build())
        tape = record(build, start)
    finally:
        torch.set_default_dtype(torch.float32)
    handed = 0
    for names, tensor in tape.tensors():
        assert tensor.dtype == eager[names[0]].dtype and torch.equal(tensor, eager[names[0]])
        handed += len(names)
    assert handed == len(eager) and eager["model.embed_tokens.weight"].dtype == torch.bfloat16


def _rss_kib(field: str) -> int:
    line = next(li for li in Path("/proc/self/status").read_text().splitlines() if li.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak resident set")
def test_replaying_a_hugging_face_build_holds_about_one_tensor_not_the_model():
    # 12 layers of 1024 (~170M parameters, 650 MiB in fp32): nn.Linear's own kaiming draws, then post_init's
    # normal_ over every weight. Built eagerly, the whole model is live at the end.
    build = hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, vocab_size=4096, hidden_size=1024,
               intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16)
    tape = record(build, torch.get_rng_state())
    metas = tensors_of(_meta(build))
    model_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in metas.values()}.values())
    largest = max(t.numel() * t.element_size() for t in metas.values())
    assert tape.peak_bytes <= 2 * largest < model_bytes / 10  # said before anything is allocated
    Path("/proc/self/clear_refs").write_text("5")  # the peak afresh from here
    before = _rss_kib("VmRSS")
    handed = 0
    for _, tensor in tape.tensors():
        handed += tensor.numel() * tensor.element_size()
    growth = (_rss_kib("VmHWM") - before) * 1024
    assert handed >= model_bytes  # every tensor came out (tied ones once)
    assert growth < tape.peak_bytes + model_bytes / 10, (growth, tape.peak_bytes, model_bytes)


def _meta(build) -> nn.Module:
    with OnMeta():
        return build()


class MadeBefore(nn.Module):
    """Uses a meta tensor made before the recorded build: the record cannot know its values."""

    outside = torch.empty(4, device="meta")

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4) + self.outside)


class Reinterpreted(nn.Module):
    """A buffer that reads a parameter's storage as another dtype: not replayed by the tape."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.register_buffer("bits", self.weight.data.view(torch.int32))


def test_what_the_tape_cannot_replay_is_said_before_anything_is_allocated():
    tape = record(MadeBefore, torch.get_rng_state())
    assert "made before the build" in tape.problem
    assert "as torch.int32" in record(Reinterpreted, torch.get_rng_state()).problem
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        next(tape.tensors())


def test_a_partial_write_keeps_the_value_it_writes_into():
    # The padding row zeroed after the draw: the draw must be kept, not treated as overwritten.
    torch.manual_seed(0)
    start = torch.get_rng_state()
    eager = nn.Embedding(16, 8, padding_idx=3).weight
    tape = record(lambda: nn.Embedding(16, 8, padding_idx=3), start)
    (names, tensor), = list(tape.tensors())
    assert names == ["weight"] and torch.equal(tensor, eager) and not tensor[3].any() and tensor.abs().sum() > 0
    assert math.isclose(tape.peak_bytes, 16 * 8 * 4)


# ---------------------------------------------------------------------- the strategy's choice (model_build)
class Built(torch.nn.Module):
    """A LightningModule's shape: configure_model() builds ``self.model`` once."""

    def __init__(self, build) -> None:
        super().__init__()
        self.build, self.model = build, None

    def configure_model(self):
        if self.model is None:
            self.model = self.build()


def exact_route_source(build):
    from lightning.pytorch.plugins.precision import Precision

    from lightning_3d.policies import resolve_policy
    from lightning_3d.strategies.model_build import WatchedBuild

    module, watched = Built(build), WatchedBuild("auto")
    with watched.context(module, Precision()):
        module.configure_model()
    policy = resolve_policy("auto")
    _, weights = watched.verdict(module, lambda m: policy.plan(m), Precision(), params_loaded=False)
    assert weights.streamed and all(t.is_meta for t in module.parameters())  # every rank goes on on meta
    return weights.source


def test_the_exact_route_replays_the_recorded_build_and_builds_on_the_host_only_when_it_cannot():
    from lightning_3d.parallel.weight_init import HostBuild

    assert isinstance(exact_route_source(BUILDS["nanogpt"]), InitTape)
    fallback = exact_route_source(Reinterpreted)
    assert isinstance(fallback, HostBuild)
    assert [names for names, _ in fallback.tensors()] == fallback.order() == [["model.weight"], ["model.bits"]]


def test_a_host_build_larger_than_the_host_memory_is_refused_before_allocating(monkeypatch):
    import lightning_3d.strategies.model_build as model_build
    from lightning_3d.errors import InitError

    monkeypatch.setattr(model_build, "host_memory_available", lambda: 4096)
    with pytest.raises(InitError, match=r"GiB of host memory.*init_from"):
        exact_route_source(BUILDS["nanogpt"])


# ---------------------------------------------------------------------- the fast route (model_init="fast")
def seeded(tape: InitTape, names, seed=5) -> dict[str, torch.Tensor]:
    return {n: t.clone() for group, t in tape.seeded_tensors(set(names), torch.device("cpu"), seed) for n in group}


@pytest.mark.parametrize("name", BUILDS)
def test_the_fast_route_gives_each_tensor_the_same_values_whichever_others_are_made(name):
    # A rank makes only its stages' tensors: each must come out as it does when all are made, so every
    # layout starts from the same weights. Drawn apart, from the build's own ops: the same distributions.
    torch.manual_seed(3)
    eager = {n: t.detach() for n, t in tensors_of(BUILDS[name]()).items()}
    tape = record(BUILDS[name], torch.get_rng_state())
    state = torch.get_rng_state()
    whole = seeded(tape, eager)
    assert torch.equal(torch.get_rng_state(), state)  # the random state is left as it was
    assert sorted(whole) == sorted(eager)
    names = sorted(eager)
    half = seeded(tape, names[::2])
    assert sorted(half) == sorted(names[::2]) or set(half) > set(names[::2])  # tied partners come along
    assert all(torch.equal(half[n], whole[n]) for n in names[::2])
    again, other_seed = seeded(tape, eager), seeded(tape, eager, seed=6)
    drawn = 0
    for n, expected in eager.items():
        got = whole[n]
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, again[n])
        if torch.equal(got, other_seed[n]):  # no draw reaches it (ones, zeros, rotary frequencies): as written
            assert torch.equal(got, expected), n
            continue
        drawn += 1
        assert not torch.equal(got, expected), n  # drawn apart: not the build's numbers...
        if expected.numel() >= 256:  # ...but from its distributions
            assert math.isclose(got.double().std(), expected.double().std(), rel_tol=0.2), n
            assert abs(got.double().mean() - expected.double().mean()) < 0.2 * expected.double().std(), n
    assert drawn >= 1


def test_the_fast_route_makes_only_the_tensors_asked_for():
    # A stage's rank holds its own tensors plus one in flight: the rest of the model is never drawn.
    build = hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, vocab_size=4096, hidden_size=256,
               intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4)
    tape = record(build, torch.get_rng_state())
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountDraws(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.endswith(("normal_", "uniform_")):
                CountDraws.elements += args[0].numel()
            return func(*args, **(kwargs or {}))

    every = [n for names in tape.order() for n in names]
    layer0 = [n for n in every if n.startswith("model.layers.0.")]
    with CountDraws():
        made = seeded(tape, layer0)
    assert sorted(made) == sorted(layer0)
    layer_elements = sum(t.numel() for t in made.values() if t.dim() == 2)
    assert CountDraws.elements == layer_elements  # nn.Linear's kaiming draw, redrawn by post_init, is skipped too
