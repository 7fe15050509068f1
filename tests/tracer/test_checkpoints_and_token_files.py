"""Checkpoints and token files as the session reads them (tracer/checkpoint.py, tracer/token_data.py,
tracer/job_inputs.py), in one process: a checkpoint saved by a single-device reference fills every
layout's shards (weights and Adam state), bad checkpoints and bad token files are refused naming what
is wrong."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from tracer import ModuleLayout, Shard
from tracer.checkpoint import INDEX, OPTIMIZER, WEIGHTS, open_checkpoint, save_checkpoint
from tracer.errors import ConfigError
from tracer.job import Session
from tracer.job_config import JobConfig, Parallel
from tracer.token_data import TokenFile

PLAN = {"0": ModuleLayout(params={"weight": Shard(0), "bias": Shard(0)}),
        "2": ModuleLayout(params={"weight": Shard(1)})}


def full_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def tp_model() -> nn.Module:
    """The same model's local shapes at tp=2 (PLAN)."""
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(8), nn.Linear(4, 3))


def session(spec: dict, role: str = "candidate", rank: int = 0, world: int = 1) -> Session:
    cfg = JobConfig(role=role, run=role, store="memory://unused", seed=3, steps=2, rank=rank,
                    world_size=world, parallel=Parallel(world_size=world), spec=spec)
    return Session(cfg)


def trained_checkpoint(tmp_path, steps: int = 2) -> tuple[str, nn.Module, torch.optim.Adam]:
    """A single-device reference after `steps` Adam steps, saved by tr.save_checkpoint."""
    model = full_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    directory = str(tmp_path / "ckpt")
    tr = session({"checkpoint": {"save": directory}, "steps": steps}, role="reference")
    tr.save_checkpoint(model, opt)
    return directory, model, opt


def test_a_saved_checkpoint_fills_every_tp_shard_with_weights_and_adam_state(tmp_path):
    directory, ref, opt = trained_checkpoint(tmp_path)
    ck = open_checkpoint(directory)
    assert (ck.kind, ck.step, ck.optimizer) == ("ttrace", 2, True)
    full = dict(ref.named_parameters())
    for rank in range(2):
        tr = session({"init": {"checkpoint": directory}}, rank=rank, world=2)
        model = tp_model()
        coords, sizes = {"tp": rank}, {"tp": 2}
        tr.init_weights(model, PLAN, coords=coords, sizes=sizes)
        got = dict(model.named_parameters())
        assert torch.equal(got["0.weight"], full["0.weight"].chunk(2, 0)[rank])
        assert torch.equal(got["2.weight"], full["2.weight"].chunk(2, 1)[rank])
        assert torch.equal(got["1.weight"], full["1.weight"])          # replicated
        adam = torch.optim.Adam(model.parameters(), lr=1e-2)
        assert tr.load_optimizer_state(adam, model, PLAN, coords=coords, sizes=sizes)
        st, ref_st = adam.state[got["0.weight"]], opt.state[full["0.weight"]]
        assert torch.equal(st["exp_avg"], ref_st["exp_avg"].chunk(2, 0)[rank])
        assert torch.equal(st["exp_avg_sq"], ref_st["exp_avg_sq"].chunk(2, 0)[rank])
        assert float(st["step"]) == float(ref_st["step"]) == 2.0
        assert tr.start_step == 2
        adam.step()   # Adam accepts the state it was given (no grads: a no-op, but the state is read)


def test_a_zero1_shard_of_the_adam_state(tmp_path):
    directory, ref, opt = trained_checkpoint(tmp_path)
    tr = session({"init": {"checkpoint": directory}})
    model = full_model()
    tr.init_weights(model)
    masters = [p.detach().chunk(2, 0)[0].clone() for p in model.parameters()]   # dp rank 0 of 2
    adam = torch.optim.Adam(masters)
    tr.load_optimizer_state(adam, model, params=masters, shard=lambda t: t.chunk(2, 0)[0])
    w = dict(ref.named_parameters())["0.weight"]
    assert torch.equal(adam.state[masters[0]]["exp_avg"], opt.state[w]["exp_avg"].chunk(2, 0)[0])


def test_a_distributed_optimizers_flat_ranges_of_the_adam_state(tmp_path):
    """megatron's DistributedOptimizer: a rank steps a flat range of some parameters and none of others
    (workloads/adapters/megatron_core.py): one cut per parameter, None where the rank owns nothing."""
    directory, ref, opt = trained_checkpoint(tmp_path)
    tr = session({"init": {"checkpoint": directory}})
    model = full_model()
    tr.init_weights(model)
    ranges = [(3, 20), None, (0, 8), None, (5, 24), (1, 3)]   # per parameter, named_parameters() order
    owners = [None if r is None else p.detach().reshape(-1)[r[0]:r[1]].clone()
              for p, r in zip(model.parameters(), ranges, strict=True)]
    adam = torch.optim.Adam([o for o in owners if o is not None])
    cuts = [None if r is None else (lambda t, r=r: t.reshape(-1)[r[0]:r[1]]) for r in ranges]
    assert tr.load_optimizer_state(adam, model, params=owners, shard=cuts)
    full = list(ref.parameters())
    for owner, r, p in zip(owners, ranges, full, strict=True):
        if r is None:
            assert owner is None
            continue
        want = opt.state[p]["exp_avg_sq"].reshape(-1)[r[0]:r[1]]
        assert torch.equal(adam.state[owner]["exp_avg_sq"], want)
    assert len(adam.state) == 4
    with pytest.raises(ConfigError, match="2 shard cuts for 6 parameters"):
        tr.load_optimizer_state(adam, model, params=owners, shard=cuts[:2])


def _rewrite(directory: str, change) -> str:
    """The checkpoint's weights changed by `change(dict)`, written again as a checkpoint."""
    ck = open_checkpoint(directory)
    params = {n: ck.tensor(n) for n in ck.shapes}
    change(params)
    out = directory + "-bad"
    save_checkpoint(out, params, {}, {"step": 0})
    return out


@pytest.mark.parametrize("change, needle", [
    (lambda p: p.pop("2.bias"), "1 missing: 2.bias"),
    (lambda p: p.update({"3.weight": torch.zeros(2)}), "1 extra (no parameter takes them): 3.weight"),
    (lambda p: p.update({"0.weight": torch.zeros(8, 5)}),
     "1 of the wrong shape: 0.weight [8, 5] (model: [8, 4])"),
])
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_naming_the_key(tmp_path, change, needle):
    directory, _, _ = trained_checkpoint(tmp_path)
    bad = _rewrite(directory, change)
    tr = session({"init": {"checkpoint": bad}})
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        tr.init_weights(full_model())


def test_hugging_face_and_dcp_directories_are_read_by_logical_name(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    ref = full_model()
    state = {n: p.detach().clone() for n, p in ref.named_parameters()}
    (tmp_path / "hf").mkdir()
    save_file(state, str(tmp_path / "hf" / WEIGHTS))
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "sharded").mkdir()   # Hugging Face's sharded form: shards and their index
    names = sorted(state)
    for i, part in enumerate((names[:3], names[3:])):
        save_file({n: state[n] for n in part}, str(tmp_path / "sharded" / f"model-{i}.safetensors"))
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f"model-{int(n not in names[:3])}.safetensors" for n in names}}))
    for kind in ("hf", "dcp", "sharded"):
        tr = session({"init": {"checkpoint": str(tmp_path / kind)}})
        model = tp_model()
        with pytest.warns(UserWarning) if kind == "dcp" else _nothing():
            tr.init_weights(model, PLAN, coords={"tp": 1}, sizes={"tp": 2})
        assert torch.equal(dict(model.named_parameters())["0.weight"], state["0.weight"][4:])
        assert tr.start_step == 0 and not tr.checkpoint.optimizer


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_unreadable_checkpoints_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        open_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="holds none of"):
        open_checkpoint(str(tmp_path))
    directory, _, _ = trained_checkpoint(tmp_path)
    (tmp_path / "ckpt" / OPTIMIZER).write_bytes(b"\x10\x00")   # truncated
    with pytest.raises(ConfigError, match="cannot be read"):
        open_checkpoint(directory)
    assert (tmp_path / "ckpt" / INDEX).exists()


def test_the_session_refuses_inputs_a_job_never_takes(tmp_path):
    tr = session({"init": {"checkpoint": str(tmp_path)}})
    with pytest.raises(ConfigError, match="did not call tr.init_weights"):
        tr.attach(full_model(), PLAN, coords={"tp": 0}, sizes={"tp": 1})
    assert "tr.token_batch" in session({"data": {"path": "x.bin"}})._inputs_unused(attaching=False)
    assert "tr.save_checkpoint" in session({"checkpoint": {"save": "d"}}, role="reference")._inputs_unused(
        attaching=False)
    assert session({"checkpoint": {"save": "d"}})._inputs_unused(attaching=False) is None   # candidate


# -- token files ---------------------------------------------------------------------------------
def tokens(tmp_path, ids, name="tokens.bin", dtype=np.uint16) -> str:
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, np.asarray(ids, dtype=dtype))
    else:
        np.asarray(ids, dtype=dtype).tofile(path)
    return str(path)


def test_a_step_reads_the_same_windows_of_the_file_in_every_run(tmp_path):
    ids = np.arange(1000) % 97
    path = tokens(tmp_path, ids)
    f = TokenFile(path)
    a = f.batch(seed=1, step=5, global_batch=4, seq_len=8, vocab=128)
    assert a.shape == (4, 9) and a.dtype == torch.int64
    assert torch.equal(a, TokenFile(path).batch(1, 5, 4, 8, 128))
    assert not torch.equal(a, f.batch(1, 6, 4, 8, 128))
    for row in a.numpy():   # each window is consecutive tokens of the file
        start = int(np.flatnonzero((ids[:-8] == row[0]) & (ids[1:-7] == row[1]))[0])
        assert (ids[start:start + 9] == row).all()
    npy = tokens(tmp_path, ids, "tokens.npy", np.int32)
    assert torch.equal(TokenFile(npy, "uint32").batch(1, 5, 4, 8, 128), a)   # .npy: its own dtype
    wide = tokens(tmp_path, ids, "wide.bin", np.uint32)
    assert torch.equal(TokenFile(wide, "uint32").batch(1, 5, 4, 8, 128), a)


def test_the_session_offsets_the_data_step_by_the_checkpoints(tmp_path):
    directory, _, _ = trained_checkpoint(tmp_path, steps=3)
    path = tokens(tmp_path, np.arange(500) % 50)
    tr = session({"init": {"checkpoint": directory}, "data": {"path": path}})
    assert torch.equal(tr.token_batch(0, 4, 8, 64), TokenFile(path).batch(3, 3, 4, 8, 64))
    plain = session({})
    from tracer import token_batch

    assert torch.equal(plain.token_batch(1, 4, 8, 64), token_batch(3, 1, 4, 8, 64))


@pytest.mark.parametrize("ids, kw, needle", [
    (np.arange(5), {}, "holds 5 tokens, fewer than one window of model.seq_len \\+ 1 = 9"),
    (np.r_[np.zeros(300), [200], np.zeros(10)], {}, "token id 200 at offset 300 .* outside model.vocab=128"),
])
def test_bad_token_files_are_refused_naming_the_file_and_what_is_wrong(tmp_path, ids, kw, needle):
    path = tokens(tmp_path, ids)
    with pytest.raises(ConfigError, match=needle) as e:
        TokenFile(path, **kw).check(seq_len=8, vocab=128)
    assert path in str(e.value)
    if "vocab" in needle:   # the rank's own check of the windows it reads names it too
        with pytest.raises(ConfigError, match="token id 200"):
            for step in range(50):
                TokenFile(path).batch(0, step, 8, 8, 128)


def test_token_files_of_the_wrong_kind(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match="not a whole number of uint16"):
        TokenFile(str(odd))
    with pytest.raises(ConfigError, match="data.dtype=int8"):
        TokenFile(tokens(tmp_path, [1, 2]), "int8")
    with pytest.raises(ConfigError, match="token ids are integers"):
        TokenFile(tokens(tmp_path, [1.5], "f.npy", np.float32))
    with pytest.raises(ConfigError, match="is not a file"):
        TokenFile(str(tmp_path / "missing.bin"))


_PLAIN_ON_TWO_RANKS = """
import json, os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    from tracer.checkpoint_gather import plain_not_replicated
    same, apart = torch.ones(3), torch.ones(3)
    apart[1] += r * 1e-7    # one element one rounding apart on rank 1
    got = [plain_not_replicated([("same", same), ("apart", apart)]),
           plain_not_replicated([("same", same), ("split", torch.zeros(2 + r))])]   # shards of two sizes
    # A plan's layouts: a column shard over tp and a replica, each rank's local tensors gathered to rank 0
    from tracer.checkpoint_gather import assembled_on_rank0, refusal
    from tracer.layouts import Layout, Shard
    full = torch.arange(12.0).reshape(4, 3)
    layouts = {"w": Shard(0), "b": Layout()}
    local = {"w": full.chunk(2)[r].clone(), "b": torch.ones(3)}
    adam = {n: {"exp_avg": t * 2} for n, t in local.items()}
    whole = assembled_on_rank0(local, adam, layouts, {"tp": r}, {"tp": 2})
    if r == 0:
        assert torch.equal(whole[0]["w"], full) and torch.equal(whole[1]["w"]["exp_avg"], full * 2)
        assert torch.equal(whole[0]["b"], torch.ones(3))
    else:
        assert whole is None
    local["b"][0] += r   # replicas that differ: the reference's ranks do not hold one model
    try:
        assembled_on_rank0(local, {}, layouts, {"tp": r}, {"tp": 2})
        got.append("no error")
    except Exception as e:
        got.append(str(e))
    named = list(local.items())
    got.append([refusal(named, [local["w"], local["b"]], 2, layouts),
                refusal(named, [local["w"][:1], local["b"]], 1, layouts),   # a distributed optimizer's range
                refusal(named, [local["w"], local["b"]], 1, {"w": Layout(partial=("tp",)), "b": Layout()}),
                refusal(named, [local["w"], local["b"]], 1, layouts)])
    if r == 0:
        print(json.dumps(got))
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.start_processes(rank, args=(port,), nprocs=2, start_method="fork")
"""


def test_a_multi_rank_save_takes_plain_parameters_only_where_every_rank_holds_the_same():
    """checkpoint.save from a reference on several ranks (tracer/checkpoint_gather.py). Attached
    without a plan, it writes rank 0's plain parameters as the whole tensors: only where they are
    replicas; a value or a shape that differs between ranks names them. With a plan, rank 0
    reassembles every rank's shards and Adam state by their layouts, and replicas that differ are an
    error naming them. Pipeline stages, an optimizer's ranges and partial-sum parameters are refused."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _PLAIN_ON_TWO_RANKS], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got[:2] == [["apart"], ["split"]]
    assert "b's replicas on ranks 0 and 1 differ in 1 elements" in got[2], got[2]
    assert got[3][0] == "runs 2 pipeline stages" and "ranges of parameters ['w']" in got[3][1]
    assert got[3][2] == "its plan lays parameters ['w'] out as partial sums" and got[3][3] is None
