"""Advantages and aggregation against their definitions, including degenerate groups and ragged masks."""

import pytest
import torch

from tether.algo import ADVANTAGES, aggregate, compute_advantages, zero_variance_groups

pytestmark = pytest.mark.usefixtures("float64")


def test_grpo_dr_grpo_rloo_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    m0, s0 = 0.5, torch.tensor([1.0, 0, 0, 1]).std().item()  # unbiased std
    want = torch.tensor([(1 - m0) / (s0 + 1e-6), -m0 / (s0 + 1e-6), -m0 / (s0 + 1e-6), (1 - m0) / (s0 + 1e-6),
                         -1 / (2 ** 0.5 + 1e-6), 1 / (2 ** 0.5 + 1e-6)])
    assert torch.allclose(compute_advantages("grpo", r, g), want)
    assert torch.allclose(compute_advantages("dr_grpo", r, g), torch.tensor([0.5, -0.5, -0.5, 0.5, -1, 1]))
    assert torch.equal(compute_advantages("group_mean", r, g), compute_advantages("dr_grpo", r, g))
    loo = torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 3 - 5, 5 - 3])
    assert torch.allclose(compute_advantages("rloo", r, g), loo)
    assert torch.allclose(compute_advantages("batch_mean", r, g), r - r.mean())
    assert torch.allclose(compute_advantages("reinforce_pp", r, g), (r - r.mean()) / (r.std() + 1e-6))
    d = r - torch.tensor([0.5, 0.5, 0.5, 0.5, 4, 4])
    assert torch.allclose(compute_advantages("reinforce_pp_baseline", r, g), (d - d.mean()) / (d.std() + 1e-6))


def test_groups_need_not_be_contiguous():
    r = torch.tensor([1.0, 5.0, 0.0, 3.0])
    g = torch.tensor([7, 2, 7, 2])
    assert torch.allclose(compute_advantages("dr_grpo", r, g), torch.tensor([0.5, 1.0, -0.5, -1.0]))


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_equal_rewards_and_singleton_groups_give_finite_zeros(name):
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 2.0])
    g = torch.tensor([0, 0, 0, 1, 1, 2])  # group 0 all equal, group 1 all equal, group 2 of size 1
    a = compute_advantages(name, r, g)
    assert torch.isfinite(a).all()
    if name not in ("batch_mean", "reinforce_pp"):  # group-relative estimators
        assert torch.equal(a, torch.zeros_like(a))
    a1 = compute_advantages(name, torch.tensor([2.0]), torch.tensor([0]))
    assert torch.isfinite(a1).all() and (a1 == 0).all()
    allsame = compute_advantages(name, torch.ones(4), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(allsame, torch.zeros(4))


def test_zero_variance_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0])
    g = torch.tensor([0, 0, 1, 1, 2])
    assert zero_variance_groups(r, g).tolist() == [True, True, False, False, True]


def ragged():
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return loss, mask


def test_aggregation_definitions_on_ragged_masks():
    loss, mask = ragged()
    rows = [loss[0, :5], loss[1, :2], loss[2, :1]]
    allt = torch.cat(rows)
    assert float(aggregate(loss, mask, "token-mean")) == pytest.approx(float(allt.mean()))
    assert float(aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx(sum(float(r.mean()) for r in rows) / 3)
    assert float(aggregate(loss, mask, "seq-mean-token-sum")) == pytest.approx(sum(float(r.sum()) for r in rows) / 3)
    assert float(aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=8)) == pytest.approx(
        sum(float(r.sum()) for r in rows) / (3 * 8))
    # padding values never leak in
    poisoned = loss.masked_fill(~mask, 1e6)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert float(aggregate(poisoned, mask, mode)) == pytest.approx(float(aggregate(loss, mask, mode)))


def test_aggregation_errors():
    loss, mask = ragged()
    with pytest.raises(ValueError, match="max_len"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="Valid choices"):
        aggregate(loss, mask, "token_mean")
