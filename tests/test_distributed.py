"""fastagg.distributed on a real torch.distributed group: gloo, 2 and 4 processes on 127.0.0.1 (free ports, bounded
time, every process ended). Each rank holds some of a round's clients; every rank must take the step of all the
clients in one process, together."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from distributed_cases import BOUNDS, CASES, CHECKPOINTED, OPTIMIZERS, ROUNDS, data, params0
from fastagg.testing import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = 120  # seconds for a whole group



def spawn(case: str, world: int, tmp_path, timeout_s: float = 20) -> list:
    """Runs ``case`` on ``world`` ranks; returns each rank's result (or raises with the ranks' output)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "GROUP_TIMEOUT_S": str(timeout_s),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "distributed_worker.py"), case, str(tmp_path)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    outputs = []
    try:
        for r, p in enumerate(procs):
            if case == "hung_rank" and r == world - 1:
                p.kill()  # the hung rank: the others have answered by now
            outputs.append(p.communicate(timeout=LIMIT)[0])
    finally:
        for p in procs:  # never leave a rank behind
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    if case not in ("dead_rank", "hung_rank"):
        bad = [r for r, res in enumerate(results) if res is None or "error" in res]
        assert not bad, "\n".join(f"rank {r}: {results[r]}\n{outputs[r][-2000:]}" for r in bad)
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case, rtol, atol", [("optimizers", 1e-5, 2e-6), ("optimizers64", 1e-13, 1e-15)])
def test_every_server_optimizer_on_r_ranks_equals_one_process(case, rtol, atol, world, tmp_path):
    """float64: equal to 1e-13; float32: to the rounding of a float32 sum taken in another order (the params are
    O(1), FedExP's eta up to ~10 amplifies the mean's rounding). 3 ranks: rank 1 holds no client and takes part
    with a zero share (a [0, d] input)."""
    ranks = spawn(case, world, tmp_path)
    ref = CASES[case](0, 1, None)
    for name, rounds in ref.items():
        for rnd in range(ROUNDS):
            w_ref, eta_ref, sq_ref, m_ref = rounds[rnd]
            for r, res in enumerate(ranks):
                w, eta, sq, m = res[name][rnd]
                assert m == m_ref == BOUNDS[world][-1]
                # every rank holds the same bits; they match one process to the sum's rounding
                assert torch.equal(w, ranks[0][name][rnd][0]), (name, rnd, r)
                torch.testing.assert_close(w, w_ref, rtol=rtol, atol=atol, msg=f"{name} round {rnd}")
                assert eta == pytest.approx(eta_ref, rel=rtol * 10)
                torch.testing.assert_close(sq, sq_ref, rtol=rtol, atol=0)  # per client, gathered


def test_one_rank_is_the_single_process_step_bit_for_bit(tmp_path):
    (only,) = spawn("optimizers", 1, tmp_path)
    ref = CASES["optimizers"](0, 1, None)
    for name in ref:
        for rnd in range(ROUNDS):
            assert torch.equal(only[name][rnd][0], ref[name][rnd][0]) and only[name][rnd][1] == ref[name][rnd][1]


def test_functional_steps_take_a_group(tmp_path):
    ranks = spawn("functional", 2, tmp_path)
    ref = CASES["functional"](0, 1, None)
    for res in ranks:
        for a, b in zip(res["fedexp"], ref["fedexp"]):
            if isinstance(b, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
            else:
                assert a == pytest.approx(b, rel=1e-5)
        torch.testing.assert_close(res["fedavg"][0], ref["fedavg"][0], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_a_non_finite_client_on_one_rank_stops_every_rank_together(world, tmp_path):
    for r, res in enumerate(spawn("nonfinite", world, tmp_path)):
        assert "deltas[5] contain NaN or Inf; nothing was updated" in res["raise"], (r, res)
        assert res["raise_params_unchanged"] and res["skip_params_unchanged"]
        assert res["skip_finite"] is False and res["skip_bad"] == [5]


def test_mismatched_shapes_are_refused_on_every_rank_before_the_data_moves(tmp_path):
    for res in spawn("mismatch", 2, tmp_path):
        assert "differ in size or dtype (rank 0: 1003 elements of torch.float32, rank 1: 1004" in res["message"]
        assert res["unchanged"]


def test_accumulators_with_different_buffers_are_refused_on_every_rank(tmp_path):
    for res in spawn("buffer_mismatch", 2, tmp_path):
        assert "differ in their buffers (elements: rank 0: 3, rank 1: 4)" in res["message"], res["message"]
        assert res["unchanged"]


def test_a_dead_rank_ends_the_step_with_a_clear_error_instead_of_a_hang(tmp_path):
    results = spawn("dead_rank", 2, tmp_path)
    assert results[1] is None  # it died
    assert "a rank died" in results[0]["message"] and results[0]["unchanged"]
    assert params0().numel() > 0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case, rtol, atol", [("sharded", 1e-13, 1e-15), ("sharded32", 1e-5, 2e-6)])
def test_sharded_optimizers_equal_the_unsharded_one_and_hold_a_slice_of_the_state(case, rtol, atol, world, tmp_path):
    """Parameter-sharded steps: every optimizer over 3 rounds, the gathered params equal one process's (the mean
    of a slice is the same kernel's; the norms are sums over slices, so eta differs by rounding), and each rank's
    state buffers hold 1/R of the model (to the remainder of an uneven split)."""
    ranks = spawn(case, world, tmp_path)
    ref = CASES[case](0, 1, None)
    for name in OPTIMIZERS:
        for rnd in range(ROUNDS):
            for res in ranks:
                w, eta, sq, m = res[name][rnd]
                assert m == ref[name][rnd][3] and torch.equal(w, ranks[0][name][rnd][0])
                torch.testing.assert_close(w, ref[name][rnd][0], rtol=rtol, atol=atol, msg=f"{name} round {rnd}")
                assert eta == pytest.approx(ref[name][rnd][1], rel=10 * rtol)
                torch.testing.assert_close(sq, ref[name][rnd][2], rtol=10 * rtol, atol=0)
        full_state = ref[name + " state"]
        for res in ranks:
            for buf, n in res[name + " state"].items():
                assert n in (full_state[buf] // world, full_state[buf] // world + 1), (name, buf, n)


def test_a_sharded_checkpoint_reshards_to_another_world_size(tmp_path):
    """Two sharded rounds on 2 ranks, the per-rank checkpoints resharded to 1 rank and loaded into an unsharded
    optimizer: its third round equals three unsharded rounds (float64); resharded to 3, the slices follow
    distributed.bounds and join to the same buffers."""
    from fastagg import distributed, server

    ranks = spawn("sharded_checkpoint", 2, tmp_path)
    for name in CHECKPOINTED:
        dicts = [res[name][0] for res in ranks]
        (whole,) = distributed.reshard(dicts, 1)
        w = torch.cat([res[name][1] for res in ranks])
        opt = getattr(server, name)(w, **OPTIMIZERS[name])
        opt.load_state_dict(whole)
        ref_w = params0(torch.float64)
        ref = getattr(server, name)(ref_w, **OPTIMIZERS[name])
        for rnd in range(3):
            deltas, controls, weights = data(rnd, torch.float64)
            args = (deltas, controls) if name.startswith("Scaffold") else (deltas,)
            ref.step(*args, weights=weights)
            if rnd == 2:
                opt.step(*args, weights=weights)
        torch.testing.assert_close(w, ref_w, rtol=1e-13, atol=1e-15, msg=name)
        three = distributed.reshard(dicts, 3)
        numel = w.numel()
        for r, sd in enumerate(three):
            start, stop = distributed.bounds(numel, 3, r)
            assert tuple(sd["fastagg"]["layout"][0][1]) == (stop - start,)
        for k, v in server.flat_checkpoint(whole)["state"].items():
            if v.dim():
                assert torch.equal(torch.cat([server.flat_checkpoint(sd)["state"][k] for sd in three]), v)
    bad = [dict(d) for d in (ranks[0]["FedAdam"][0], ranks[1]["FedAdam"][0])]
    bad[1]["state"] = {0: {**bad[1]["state"][0], "step": bad[1]["state"][0]["step"] + 1}}
    with pytest.raises(ValueError, match="rank 1's 'step'"):
        distributed.reshard(bad, 1)


def test_a_hung_rank_ends_the_step_after_the_groups_timeout(tmp_path):
    results = spawn("hung_rank", 2, tmp_path, timeout_s=4)
    res = results[0]
    # it answered (a hang would have hit spawn's limit and failed the test) with the timeout's error
    assert "hung past the group's timeout" in res["message"] and res["unchanged"], res


@pytest.mark.parametrize("world", [2, 4])
def test_accumulators_on_every_rank_step_as_one(world, tmp_path):
    """Each rank streams its clients into an Accumulator; the step over the group equals one process's
    accumulator of all clients (float64; the sums are added in another order)."""
    ranks = spawn("accumulated", world, tmp_path)
    ref = CASES["accumulated"](0, 1, None)
    for name, rounds in ref.items():
        for rnd, (w_ref, eta_ref, sq_ref) in enumerate(rounds):
            for res in ranks:
                w, eta, sq = res[name][rnd]
                assert torch.equal(w, ranks[0][name][rnd][0])
                torch.testing.assert_close(w, w_ref, rtol=1e-13, atol=1e-15, msg=f"{name} round {rnd}")
                assert eta == pytest.approx(eta_ref, rel=1e-12)
                torch.testing.assert_close(sq, sq_ref, rtol=0, atol=0)


@pytest.mark.parametrize("case, world", [("batchnorm_models", 2), ("batchnorm_accumulated", 2),
                                         ("batchnorm_models", 3)])
def test_model_buffers_average_over_every_ranks_clients(case, world, tmp_path):
    """Full BatchNorm models, given as rows or folded into each rank's Accumulator: running statistics become the
    weighted average over all ranks' clients, the counter advances by the rounded weighted average; params as one
    process (float64). 3 ranks: rank 1 has no client (an empty list) and adds zeros for the model's buffers."""
    ranks = spawn(case, world, tmp_path)
    ref = CASES["batchnorm_models"](0, 1, None)
    assert any(not v.is_floating_point() for v in ref.values())
    for res in ranks:
        for k, v in ref.items():
            assert res[k].dtype == v.dtype
            torch.testing.assert_close(res[k], v, rtol=1e-13, atol=1e-15, msg=k)


def test_a_sharded_optimizer_averages_the_buffers_of_the_entries_it_owns(tmp_path):
    """A BatchNorm model's state_dict split by layer over 2 ranks: each rank's entries (running statistics and the
    counter included) equal one process's over the whole state_dict, and eta (norms over both ranks) is its eta."""
    ranks = spawn("sharded_batchnorm", 2, tmp_path)
    ref = CASES["sharded_batchnorm"](0, 1, None)
    for name, (state_ref, eta_ref) in ref.items():
        owned = [set(res[name][0]) for res in ranks]
        assert owned[0] and owned[1] and not owned[0] & owned[1] and owned[0] | owned[1] == set(state_ref)
        assert any("running_mean" in k for k in owned[0])
        for res in ranks:
            state, eta = res[name]
            assert eta == pytest.approx(eta_ref, rel=1e-12), name
            for k, v in state.items():
                assert v.dtype == state_ref[k].dtype
                torch.testing.assert_close(v, state_ref[k], rtol=1e-13, atol=1e-15, msg=f"{name} {k}")


def test_a_rank_with_more_clients_than_the_header_carries(tmp_path):
    """Up to 64 clients a rank, the weights travel with the shape check; beyond, in a gather of their own."""
    from fastagg import distributed

    assert distributed.WEIGHTS_INLINE < 70
    ranks = spawn("many_clients", 2, tmp_path)
    ref = CASES["many_clients"](0, 1, None)
    for res in ranks:
        torch.testing.assert_close(res["w"], ref["w"], rtol=1e-13, atol=1e-15)
        assert res["eta"] == pytest.approx(ref["eta"], rel=1e-12)


# -- ranks out of step, keys by name (issue 19) -------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_whose_input_is_bad_makes_every_rank_fail_that_step_at_once(world, tmp_path):
    """The other ranks raise the error that names the failing rank, not the group's timeout error (which they
    raised before: they waited in the collective the failing rank never joined)."""
    ranks = spawn("local_failure", world, tmp_path, timeout_s=60)
    for r, res in enumerate(ranks):
        first = res["first"]
        assert "timeout" not in first["message"]
        if r == world - 1:
            assert first["raised"] == "ValueError" and "1004 elements" in first["message"]
        else:
            assert first["raised"] == "ValueError" and f"rank {world - 1} could not take part" in first["message"]
        assert res["unchanged"] and res["second"]["raised"] is None
        assert torch.equal(res["w"], ranks[0]["w"])  # the next step: the same bits on every rank


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_clients_with_group_equal_one_process(world, tmp_path):
    """int8, top-k and fp8 clients spread over the ranks (3 ranks: rank 1 holds none and passes []), folded where
    they lie on each rank: every rank's params equal one process stepping on all clients (float32 sums in another
    order); with rank 0 sending float32 updates instead (mixed), or one float32 update beside its compressed ones in
    one list, the same to float32 rounding."""
    from distributed_cases import COMPRESSED_OPTIMIZERS

    ranks = spawn("compressed", world, tmp_path)
    ref = CASES["compressed"](0, 1, None)
    for mixed in (False, True, "list"):
        for name in COMPRESSED_OPTIMIZERS:
            for rnd in range(ROUNDS):
                w_ref, eta_ref, sq_ref, n_ref = ref[name, False][rnd]
                for res in ranks:
                    w, eta, sq, n = res[name, mixed][rnd]
                    assert n == n_ref == 8
                    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=2e-6, msg=f"{name} {mixed} round {rnd}")
                    assert eta == pytest.approx(eta_ref, rel=1e-5)
                    torch.testing.assert_close(sq, sq_ref, rtol=1e-5, atol=0)
        for res in ranks:
            torch.testing.assert_close(res["functional", mixed][0], ref["functional", False][0], rtol=1e-5, atol=2e-6)
            assert res["functional", mixed][1] == pytest.approx(ref["functional", False][1], rel=1e-5)


def test_a_bad_compressed_client_on_one_rank_makes_every_rank_fail_that_step_at_once(tmp_path):
    ranks = spawn("compressed_failures", 2, tmp_path, timeout_s=60)
    assert ranks[1]["first"]["raised"] == "ValueError" and "-128" in ranks[1]["first"]["message"]
    assert "deltas[0]" in ranks[1]["first"]["message"]
    assert "timeout" not in ranks[0]["first"]["message"] and ranks[0]["first"]["raised"] is not None
    for r in ranks:
        assert r["unchanged"] and r["second"]["raised"] is None
        assert r["nan_raise"]["raised"] is not None and "timeout" not in r["nan_raise"]["message"]
        assert r["nan_raise_unchanged"]
    assert "deltas[0]" in ranks[1]["nan_raise"]["message"]
    # skip: the last rank's first client (client 3 of 8) is left out; the others step, the same on every rank
    assert ranks[0]["skip"][1] == ranks[1]["skip"][1] == 7
    assert torch.equal(ranks[0]["skip"][0], ranks[1]["skip"][0])
    assert not torch.equal(ranks[0]["skip"][0], params0())  # the step was taken
    for r in ranks:  # sharded optimizers take slices of float updates: refused on every rank at once
        assert r["sharded"]["raised"] == "TypeError" and "sharded=True" in r["sharded"]["message"]


def test_a_rank_that_fails_inside_its_pass_makes_every_rank_fail_at_once(tmp_path):
    ranks = spawn("failure_in_pass", 2, tmp_path, timeout_s=60)
    assert ranks[1]["first"]["raised"] == "RuntimeError" and "simulated" in ranks[1]["first"]["message"]
    assert ranks[0]["first"]["raised"] == "RuntimeError" and "another rank failed" in ranks[0]["first"]["message"]
    for res in ranks:  # told by the status check, not by the group's timeout
        assert "timeout" not in res["first"]["message"]
        assert res["unchanged"] and res["second"]["raised"] is None


def test_ranks_out_of_step_raise_on_every_rank_and_combine_nothing(tmp_path):
    for res in spawn("out_of_step", 2, tmp_path):
        assert res["raised"] == "RuntimeError" and "out of step" in res["message"], res
        assert res["unchanged"]


def test_state_dict_entries_are_matched_by_key_across_ranks(tmp_path):
    ranks = spawn("keys_in_another_order", 2, tmp_path)
    ref = CASES["keys_in_another_order"](0, 1, None)
    for res in ranks:
        for k, v in ref.items():
            torch.testing.assert_close(res[k], v, rtol=1e-6, atol=1e-7, msg=k)
        for k in ref:
            assert torch.equal(res[k], ranks[0][k]), k


def test_sharded_ranks_with_permuted_weights_are_refused(tmp_path):
    for res in spawn("sharded_permuted_weights", 2, tmp_path):
        assert res["raised"] == "ValueError" and "same order" in res["message"], res
        assert res["unchanged"]


def test_gather_refuses_slices_of_different_dtypes_on_every_rank(tmp_path):
    for res in spawn("gather_dtypes", 2, tmp_path):
        assert res["raised"] == "TypeError" and "differ in dtype" in res["message"], res


def test_reshard_refuses_checkpoints_out_of_order_twice_malformed_or_of_the_wrong_size(tmp_path):
    from fastagg import distributed

    ranks = spawn("sharded_checkpoint", 2, tmp_path)
    a, b = (res["FedAdam"][0] for res in ranks)
    assert a["fastagg"]["shard"] == {"rank": 0, "world": 2} and b["fastagg"]["shard"] == {"rank": 1, "world": 2}
    with pytest.raises(ValueError, match="out of rank order"):
        distributed.reshard([b, a], 1)
    with pytest.raises(ValueError, match="rank 0 twice"):
        distributed.reshard([a, a], 1)
    short = {**b, "state": {0: {**b["state"][0], "m": b["state"][0]["m"][:-1]}}}
    with pytest.raises(ValueError, match="buffer 'm' .*has shape"):
        distributed.reshard([a, short], 1)
    with pytest.raises(ValueError, match="not a state_dict"):
        distributed.reshard([a, "b"], 1)
    with pytest.raises(ValueError, match=r"\['state'\] must map"):
        distributed.reshard([a, {k: v for k, v in b.items() if k != "state"}], 1)
    with pytest.raises(ValueError, match="world size"):
        distributed.reshard([a, b], 0)
    with pytest.raises(ValueError, match="group of 2 ranks; 3"):
        distributed.reshard([a, b, b], 1)
    untagged = [{**sd, "fastagg": {k: v for k, v in sd["fastagg"].items() if k != "shard"}} for sd in (a, b)]
    swapped = [untagged[1], untagged[0]]
    if untagged[0]["fastagg"]["layout"][0][1] != untagged[1]["fastagg"]["layout"][0][1]:  # uneven slices: caught by their sizes
        with pytest.raises(ValueError, match="slice holds"):
            distributed.reshard(swapped, 1)
    (whole,) = distributed.reshard([a, b], 1)
    assert "shard" not in whole["fastagg"]
