"""torch.distributed wrappings with backend="coda", two gloo processes on CPU: DDP,
FSDP2 per block (TorchTitan's order), DTensor tensor and sequence parallelism. The
workers are in tests/_distributed.py."""

import collections

import pytest
import torch.distributed as dist

import _distributed as workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _statuses(records):
    return collections.Counter((pattern, status) for _, pattern, status, _, _ in records)


@pytest.mark.parametrize("family", ["plain", "llama"])
def test_ddp_bucket_split(family):
    """DDP's default graph split (one graph per gradient bucket): the same loss and
    gradients as DDP in eager; a norm whose GEMMs the split put in the next graph is
    reported as such, everything else rewritten."""
    results = workers.run_on_two_ranks(workers.ddp, family, "ddp_optimizer")
    for rank, res in enumerate(results):
        assert abs(res["loss"] - res["ref_loss"]) <= 1e-5 * abs(res["ref_loss"]), rank
        assert res["grad_err"] <= 1e-4, rank
        assert res["graphs"] >= 2, "the model is too small for DDP to split its graph"
        assert {g for g, *_ in res["records"]} == {rank}
        left = {code for _, _, status, code, _ in res["records"] if status != "rewritten"}
        # a later graph of the split gets the causal mask as an input: kept (with the
        # key/value repeat), as for any mask the prover cannot see built
        assert left <= {"row_scale.leaves_graph", "attention.gqa_already",
                        "attention.gqa_with_mask"}, left
    assert _statuses(results[0]["records"]) == _statuses(results[1]["records"])


@pytest.mark.parametrize("family", ["plain", "llama"])
def test_ddp_python_reducer_rewrites_as_one_process(family):
    """With optimize_ddp="python_reducer" (one graph, the reducer traced by compiled
    autograd) the rewrites are exactly those of one process without DDP."""
    results = workers.run_on_two_ranks(workers.ddp, family, "python_reducer")
    alone = collections.Counter(workers.single_process_records(family))
    for res in results:
        assert abs(res["loss"] - res["ref_loss"]) <= 1e-5 * abs(res["ref_loss"])
        assert res["grad_err"] <= 1e-4
        assert _statuses(res["records"]) == alone


@pytest.mark.parametrize("family", ["plain", "llama"])
def test_fsdp2_per_block_compile(family):
    """TorchTitan's order: each block compiled with the backend, fully_shard per block,
    then the root. Two SGD steps equal to the same wrapping in eager; every block's
    graph rewritten; the rewritten graph reads all-gathered weights, never a shard."""
    results = workers.run_on_two_ranks(workers.fsdp2, family)
    for res in results:
        for loss, ref_loss in res["losses"]:
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        assert max(res["grad_errs"]) <= 1e-4, res["grad_errs"]
        assert res["weights_whole"]
        done = {p for _, p, status, _, _ in res["records"] if status == "rewritten"}
        assert {"residual_rmsnorm_gemm", "gated_mlp", "rope"} <= done, done
        assert all(status == "rewritten" or code for _, _, status, code, _ in res["records"])


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel(sequence_parallel):
    """q/k/v and w1/w3 column-parallel, wo and w2 row-parallel (and the norms sequence-
    parallel): loss and gradients equal to one process in eager; every norm's row scale
    fused into the column-parallel GEMMs on their local shards, and SwiGLU into gate/up's;
    no producer fused across the partial sum of a row-parallel GEMM; RoPE left, with the
    reason; no weight gathered, and no layout change that DTensor in eager does not
    make."""
    results = workers.run_on_two_ranks(workers.tensor_parallel, sequence_parallel, False)
    for res in results:
        assert abs(res["loss"] - res["ref_loss"]) <= 1e-5 * abs(res["ref_loss"])
        assert res["grad_err"] <= 1e-4, res["grad_err"]
        norms = [r for r in res["records"] if r[1] == "residual_rmsnorm_gemm"]
        assert len(norms) == 5 and all(status == "rewritten" for _, _, status, _, _ in norms)
        producers = [p for *_, p in norms]
        if not sequence_parallel:  # the residual add reads the all-reduced o_proj / w2
            assert producers.count("dtensor.partial_sum") == 4, producers
        row_parallel = [r for r in res["records"] if r[3] == "dtensor.row_parallel"]
        assert len(row_parallel) == 4
        # the gated activation in the column-parallel gate/up GEMM's epilogue, on the
        # shards (the interleave of two Shard(0) weights is Shard(0): no collective)
        gated = [r for r in res["records"] if r[1] == "gated_mlp"]
        assert len(gated) == 2 and all(r[2] == "rewritten" for r in gated), gated
        rope = [r for r in res["records"] if r[1] == "rope"]
        assert rope and all(r[3] == "rope.sharded" for r in rope), rope
        gathered = [(src, dst, shape) for src, dst, shape in res["coda_moves"]
                    if shape in res["weight_shapes"]]
        assert not gathered, gathered
        # activations move as often as in eager; the deferred row scale r ([rows, 1])
        # is the one new value that moves (gathered like h; its gradient is a partial
        # sum over the ranks' columns, as h's is)
        more = {move: n for move, n in res["coda_moves"].items()
                if move[2][-1] != 1 and n > res["eager_moves"].get(move, 0)}
        assert not more, (more, res["eager_moves"])


@pytest.mark.inductor
def test_tensor_parallel_through_inductor():
    """The same, with the rewritten graph handed to Inductor (AOTAutograd traces the
    sharded fused call through to_local / from_local)."""
    for res in workers.run_on_two_ranks(workers.tensor_parallel, True, True):
        assert abs(res["loss"] - res["ref_loss"]) <= 1e-5 * abs(res["ref_loss"])
        assert res["grad_err"] <= 1e-4


def test_functional_collectives_are_not_fused_across():
    """A block written with funcol.all_reduce (no DTensor): the norm is fused after the
    reduce (row-wise program + the consumer GEMM), never into the GEMM whose output is
    reduced; the result is eager's."""
    for res in workers.run_on_two_ranks(workers.functional_collectives):
        assert res["err"] <= 1e-5
        (norm,) = [r for r in res["records"] if r[1] == "residual_rmsnorm_gemm"]
        assert norm[2] == "rewritten" and norm[4] == "collective.between", norm


def test_norm_into_a_row_parallel_gemm_is_refused():
    """RowwiseParallel splits the GEMM's input features over the ranks: a row scale
    cannot be deferred past that split (each rank would see part of every row)."""
    for res in workers.run_on_two_ranks(workers.norm_into_row_parallel):
        assert res["err"] <= 1e-5
        (norm,) = [r for r in res["records"] if r[1] == "residual_rmsnorm_gemm"]
        assert norm[2] != "rewritten" and norm[3] == "dtensor.feature_sharded", norm


def test_placement_table():
    """The fused op's sharding rule (codegen/placements.py), no process group needed."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from coda_rewrite.codegen import placements
    from coda_rewrite.codegen.program import Kind
    assert placements.gemm_layout((Replicate(),), (Shard(0),), 2) == ["columns"]
    assert placements.gemm_layout((Shard(0),), (Replicate(),), 2) == ["rows"]
    assert placements.gemm_layout(None, (Replicate(),), 2) == ["replicated"]
    assert placements.gemm_layout((Shard(1),), (Shard(1),), 2) is None   # split K: partial
    assert placements.gemm_layout((Replicate(), Shard(0)), (Shard(0), Replicate()), 2) == \
        ["columns", "rows"]
    assert placements.target(Kind.TILE, "columns") == Shard(1)
    assert placements.target(Kind.PER_ROW, "columns") == Replicate()
    assert placements.target(Kind.PER_FEATURE, "rows") == Replicate()
    assert placements.grad_placement("a", "columns") == Partial()
    assert placements.grad_placement("w", "columns") is None
    assert placements.grad_placement(Kind.PER_FEATURE, "rows") == Partial()
    per_row_out = [type("O", (), {"kind": Kind.PER_ROW})()]
    assert not placements.program_fits(per_row_out, ["columns"])
    assert placements.program_fits(per_row_out, ["rows"])


def test_column_parallel_gemms_with_biases():
    """Per-feature operands (the biases) follow the weight's row shards; outputs and every
    gradient (the input's through DTensor's reduce of the partial gradients) as the same
    wrapping in eager."""
    for res in workers.run_on_two_ranks(workers.biased_column_parallel):
        assert res["err"] <= 1e-5 and res["x_grad"] <= 1e-4 and res["grad_err"] <= 1e-4, res
        (norm,) = [r for r in res["records"] if r[1] == "residual_rmsnorm_gemm"]
        assert norm[2] == "rewritten", norm


def test_the_two_gpu_benchmark_dry_run():
    """benchmarks/distributed_step.py (the two-GPU step of issue #22) on two gloo processes
    with a tiny config: FSDP2 per layer and tensor + sequence parallelism on Hugging
    Face's Llama, each variant's loss and gathered gradients against float64, and the
    rewrites backend="coda" made under each wrapping (a run that rewrote nothing would
    time torch.compile against itself)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "benchmarks"))
    import distributed_step
    results = distributed_step.run_on_two_ranks(["fsdp2", "tp"], cpu=True)
    for res in results:
        for wrapping in ("fsdp2", "tp"):
            for variant, (loss_err, grad_err) in res[wrapping]["numerics"].items():
                assert loss_err <= 1e-5 and grad_err <= 1e-4, (wrapping, variant, grad_err)
            fused = res[wrapping]["fused"]['backend="coda"']
            done = {p for (p, status), _ in fused.items() if status == "rewritten"}
            assert {"residual_rmsnorm_gemm", "gated_mlp"} <= done, (wrapping, fused)
            assert all(len(ts) == 1 for ts in res[wrapping]["times"].values())
