"""The reference GPT, its synthetic task, and layout-independent init (meta build + replay == eager build)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_3d.models import GPT, GPTConfig, SuccessorDataset
from lightning_3d.parallel.weight_init import InitError, check_replayable, modules_without_reset, replay_init

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64)

# ------------------------------------------------------------------------------------------------- GPT


def test_forward_gives_logits_per_position_over_the_vocabulary():
    model = GPT(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (3, 10))
    assert model(tokens).shape == (3, 10, TINY.vocab_size)  # (B, T, V)


def test_sequence_longer_than_block_size_is_rejected():
    model = GPT(TINY)
    with pytest.raises(ValueError, match="sequence length 17 exceeds GPTConfig.block_size=16"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_n_embd_not_a_multiple_of_n_head_suggests_one():
    with pytest.raises(ValueError, match=r"n_embd \(31\) must be a multiple of n_head \(4\); try n_embd=32"):
        GPTConfig(n_embd=31, n_head=4)


@pytest.mark.parametrize(("field", "value"), [("n_layer", 0), ("vocab_size", -1), ("block_size", 8.0)])
def test_non_positive_or_non_int_size_is_rejected(field, value):
    with pytest.raises(ValueError, match=f"GPTConfig.{field} must be a positive integer, got {value!r}"):
        GPTConfig(**{field: value})


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        GPTConfig(n_layer=2, n_embd=32, n_head=4, bias=False),
        GPTConfig(n_layer=1, n_embd=12, n_head=3, mlp_ratio=2, vocab_size=10, block_size=5),
    ],
    ids=["tiny", "no_bias", "odd_sizes"],
)
def test_num_parameters_counts_what_the_model_holds(config):
    assert config.num_parameters() == sum(p.numel() for p in GPT(config).parameters())


# ---------------------------------------------------------------------------- layout-independent init


def eager_build(seed):
    """The reference: the model as the user wrote it, and the random state it leaves behind."""
    torch.manual_seed(seed)
    model = GPT(TINY)
    return model, torch.get_rng_state()


def meta_build(seed):
    """What the strategy does under model_init='meta': build on meta (draws nothing), then materialize."""
    torch.manual_seed(seed)
    rng_state = torch.get_rng_state()
    with torch.device("meta"):
        model = GPT(TINY)
    skeleton = copy.deepcopy(model)
    model.to_empty(device="cpu")
    return skeleton, model, rng_state


def test_meta_build_draws_no_random_numbers():
    _, _, rng_state = meta_build(seed=7)
    assert torch.equal(torch.get_rng_state(), rng_state)


@pytest.mark.parametrize("seed", [0, 1234])
def test_replay_init_gives_the_eager_weights_and_random_state(seed):
    eager, state_after_eager = eager_build(seed)
    skeleton, model, rng_state = meta_build(seed)

    replay_init(skeleton, model, rng_state)

    expected = dict(eager.named_parameters())
    assert expected.keys() == dict(model.named_parameters()).keys()
    for fqn, param in model.named_parameters():
        assert torch.equal(param, expected[fqn]), fqn
    # Randomness drawn after init (dropout, data) matches an eager run too.
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    # The skeleton was scratch space only: it stays on meta.
    assert all(p.is_meta for p in skeleton.parameters())


def test_replay_init_skips_tensors_that_live_on_another_stage():
    eager, state_after_eager = eager_build(seed=3)
    skeleton, model, rng_state = meta_build(seed=3)
    del model.lm_head  # as on a pipeline stage without the head: the FQNs of the rest are unchanged

    replay_init(skeleton, model, rng_state)

    expected = dict(eager.named_parameters())
    for fqn, param in model.named_parameters():
        assert torch.equal(param, expected[fqn]), fqn
    # The head's weights were still drawn, so every stage leaves the generator in the same state.
    assert torch.equal(torch.get_rng_state(), state_after_eager)


class Gain(nn.Module):
    """Owns a raw parameter and has no reset_parameters(): replay cannot initialize it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class NetWithGain(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gain = Gain()


def test_check_replayable_names_modules_without_reset_and_the_exact_way_out():
    assert modules_without_reset(NetWithGain()) == ["gain"]
    with pytest.raises(InitError, match="have none: gain\\.") as err:
        check_replayable(NetWithGain())
    assert "model_init='exact'" in str(err.value)


def test_check_replayable_names_the_root_when_it_owns_a_tensor():
    root = NetWithGain()
    root.register_buffer("scale", torch.ones(1))
    assert modules_without_reset(root) == ["<root>", "gain"]


def test_gpt_is_replayable():
    assert modules_without_reset(GPT(TINY)) == []
    check_replayable(GPT(TINY))


# ------------------------------------------------------------------------------------ synthetic data


def successor_data(**overrides):
    return SuccessorDataset(**{**dict(vocab_size=64, seq_len=16, num_samples=32, noise=0.1, seed=5), **overrides})


def test_sample_depends_only_on_seed_and_index():
    a, b = successor_data(), successor_data()
    for index in (0, 7, 31):
        for x, y in zip(a[index], b[index]):
            assert torch.equal(x, y)
    assert not torch.equal(a[0][0], a[1][0])


def test_targets_are_tokens_shifted_by_one():
    tokens, targets = successor_data()[3]
    assert tokens.shape == targets.shape == (16,)
    assert torch.equal(tokens[1:], targets[:-1])


def test_without_noise_every_target_is_the_successor_of_its_token():
    data = successor_data(noise=0.0)
    tokens, targets = data[0]
    assert torch.equal(targets, data.successor[tokens])
    assert data.loss_floor() == 0.0


def test_first_index_offsets_sample_ids():
    train, val = successor_data(), successor_data(first_index=32)
    val_sample, train_sample = val[2], successor_data(num_samples=64)[34]
    assert all(torch.equal(x, y) for x, y in zip(val_sample, train_sample))
    assert not torch.equal(val[0][0], train[0][0])


def test_loss_floor_lies_between_zero_and_chance():
    floor = successor_data().loss_floor()
    assert 0 < floor < math.log(64)


# ------------------------------------------------------------------------------------------- learning


def test_gpt_learns_the_successor_rule_in_100_steps():
    # Measured (seeds 0, 1, 2, 1234): mean loss of the last 10 steps 0.79-0.97 nats, floor 0.73, chance 4.16;
    # under a second on CPU.
    torch.manual_seed(0)
    model = GPT(TINY)
    data = SuccessorDataset(vocab_size=64, seq_len=16, num_samples=100 * 16, noise=0.1, seed=1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens, targets in DataLoader(data, batch_size=16):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    assert len(losses) == 100
    assert losses[0] > math.log(64) - 0.2  # starts at chance
    final = sum(losses[-10:]) / 10
    assert final < math.log(64) - 1.5
    assert final < data.loss_floor() + 0.5  # close to what the rule allows, not just better than chance


def test_gpt_config_rejects_bool_sizes():
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=True)
