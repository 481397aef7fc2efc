"""``--ckpt-format torch_dist``: checkpoints that resume on another data-parallel size.

Why a second format: ``torch`` stores each rank's slice of megatron-core's flat optimizer buffers,
so it loads only into the same layout and bucket padding. This one uses megatron-core's
``dist_checkpointing`` as Megatron-LM does (sharded state dicts, ``fully_sharded_model_space``),
resharded on load; per-rank state (RNG, quantization) lives in ``{iter_dir}/rank_state/`` with the
layout it was written under and is restored as written or re-derived (logged). It only fills and
reads one iteration directory (:mod:`.save_load` owns the atomic save protocol) and returns the
digests of the files each rank wrote (:mod:`.integrity`). See "Checkpoints" in
docs/architecture.md.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron.training.checkpoint import integrity as checkpoint_integrity
from megatron.training.checkpoint.integrity import FileDigest
from megatron.training.checkpoint.layout import saved_arg
from megatron.training.errors import StartupError

RANK_STATE_DIR = "rank_state"
# Every parameter's optimizer state saved in the parameter's own shape (Megatron-LM's
# --dist-ckpt-optim-fully-reshardable): independent of DP size and bucket padding.
OPTIMIZER_SHARDING = "fully_reshardable"


def is_torch_dist_checkpoint(path: str) -> bool:
    """True when ``path`` is an iteration directory written in this format."""
    return os.path.isfile(os.path.join(path, "metadata.json"))


def run_layout() -> Dict[str, int]:
    """The parallel layout of this run (what a per-rank state depends on)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank()}


def _dist_checkpointing():
    """megatron-core's dist_checkpointing, imported lazily; in CPU mode its CUDA touch points
    are redirected like the rest of megatron-core's (modules imported after the first call)."""
    from megatron.core import dist_checkpointing
    # The torch_dist strategy's modules are otherwise imported at the first save, after the
    # CPU-mode redirection below would have run.
    from megatron.core.dist_checkpointing.strategies import torch as _torch_strategy  # noqa: F401

    from megatron.training.cpu_mode import refresh_cpu_mode

    refresh_cpu_mode()  # no-op outside CPU mode
    return dist_checkpointing


def _sharded_state_dict(model: List[torch.nn.Module], optimizer: Any, is_loading: bool,
                        save_optim: bool) -> Dict[str, Any]:
    """Model (and optimizer) sharded state dicts, keyed as Megatron-LM keys them."""
    state: Dict[str, Any] = {}
    metadata = {"distrib_optim_sharding_type": OPTIMIZER_SHARDING}
    if len(model) == 1:
        state["model"] = model[0].module.sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            state[f"model{i}"] = chunk.module.sharded_state_dict()
    if save_optim:
        model_sd = {k: v for k, v in state.items() if k.startswith("model")}
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=metadata)
    return state


def save(directory: str, args: argparse.Namespace, model: List[torch.nn.Module], optimizer: Any,
         common: Dict[str, Any], per_rank: Dict[str, Any]) -> List[FileDigest]:
    """Collective: write one iteration into the empty ``directory``.

    ``common`` (iteration, scheduler, args, ...) is written once by rank 0 through
    dist_checkpointing's common state; ``per_rank`` (RNG, quantization) into this rank's file.
    Returns the digests of the files this rank wrote (its ``.distcp`` shards and its per-rank
    file) for the checkpoint's manifest (:mod:`.integrity`).
    """
    dcp = _dist_checkpointing()
    state = _sharded_state_dict(model, optimizer, is_loading=False,
                                save_optim=not args.no_save_optim)
    # common.pt is read back with torch.load(weights_only=True): plain values only.
    state.update({**common, "args": _plain_args(common["args"])})
    dcp.save(state, directory)  # default sharded strategy: torch_dist
    rank_dir = os.path.join(directory, RANK_STATE_DIR)
    os.makedirs(rank_dir, exist_ok=True)
    layout = run_layout()
    path = _rank_state_path(directory, layout["tp_rank"], layout["pp_rank"], layout["dp_rank"])
    digests = checkpoint_integrity.digest_own_distcp_files(directory, torch.distributed.get_rank())
    digests.append(checkpoint_integrity.save_torch({"layout": layout, **per_rank}, path, directory))
    return digests


def _saved_size(saved_layout: Dict[str, Any], key: str) -> Any:
    """A parallel size of a saved layout (expert parallelism 1 where it predates MoE)."""
    return saved_layout.get(key, 1 if key == "ep" else None)


def _rank_state_path(directory: str, tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    """Named by parallel coordinates, so a loader finds the file it needs without listing."""
    return os.path.join(directory, RANK_STATE_DIR,
                        f"tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:05d}.pt")


def _per_rank_state(directory: str, layout: Dict[str, int],
                    saved_args: Any = None) -> Tuple[Dict[str, Any], bool]:
    """This rank's file if the layout is unchanged, else DP rank 0's of the same (TP, PP) rank
    (Megatron seeds all DP ranks of a (TP, PP) rank alike). Returns (state, same_layout).

    With the layout unchanged this rank's own file must be there: without it the rank took DP
    rank 0's RNG state and restarted its LoCo errors and stochastic-rounding generators, and the
    resumed run differed with no word (the torch format refuses the same case)."""
    def read(dp_rank: int) -> Dict[str, Any]:
        path = _rank_state_path(directory, layout["tp_rank"], layout["pp_rank"], dp_rank)
        return checkpoint_integrity.torch_load(path, directory, map_location="cpu",
                                               weights_only=False) \
            if os.path.isfile(path) else {}

    sizes = ("tp", "pp", "dp", "ep")
    own = read(layout["dp_rank"])
    if own and all(_saved_size(own["layout"], k) == layout[k] for k in sizes):
        return own, True
    first = read(0)
    saved = {"tp": _get(saved_args, "tensor_model_parallel_size"),
             "pp": _get(saved_args, "pipeline_model_parallel_size"),
             "dp": _get(saved_args, "data_parallel_size"),
             "ep": _get(saved_args, "expert_model_parallel_size") or 1}
    if first:
        saved = {k: _saved_size(first["layout"], k) for k in sizes}
    if not own and all(saved[k] == layout[k] for k in sizes):
        path = _rank_state_path(directory, layout["tp_rank"], layout["pp_rank"],
                                layout["dp_rank"])
        raise checkpoint_integrity.CheckpointIntegrityError(checkpoint_integrity.damaged(
            directory, path, "is missing: this rank's RNG state, LoCo error buffers and "
            "stochastic-rounding generators would come from another rank (or restart), and "
            "the resumed run would differ from the uninterrupted one"))
    if first and all(first["layout"].get(k) == layout[k] for k in ("tp", "pp")):
        return first, False
    return {}, False


def load(directory: str, args: argparse.Namespace, model: List[torch.nn.Module], optimizer: Any,
         load_optim: bool, log: Callable[[str], None], finetune: bool = False) -> Dict[str, Any]:
    """Collective: load ``directory`` into ``model`` / ``optimizer`` (resharding as needed).

    Returns the common state (iteration, train_state, scheduler, args) with the per-rank state
    under ``"rng_state"`` / ``"quantization"`` (absent where it does not apply) and
    ``"same_layout"``.  A checkpoint Megatron-LM wrote (its saved args are a Namespace, ours a
    plain dict) gives its model weights only (:func:`_check_foreign`)."""
    from megatron.training.data.datasets import collective_device, raise_if_any_rank_failed

    dcp = _dist_checkpointing()
    common, problem = {}, None
    try:
        common = read_common_state(dcp, directory)
        saved_top = _saved_top_keys(dcp, directory)
    except StartupError as exc:  # damaged, or not ours (Megatron-LM's): every rank stops
        problem = str(exc)
    raise_if_any_rank_failed(problem, collective_device())
    saved_args = common.get("args")
    foreign = isinstance(saved_args, argparse.Namespace)
    if foreign:
        raise_if_any_rank_failed(_check_foreign(directory, common, args, finetune),
                                 collective_device())
    else:   # Megatron-LM's is in _check_foreign's architecture comparison
        from megatron.training.checkpoint.layout import padded_vocab_problem

        raise_if_any_rank_failed(padded_vocab_problem(directory, saved_args, args),
                                 collective_device())
    load_optim = load_optim and "optimizer" in saved_top and not foreign
    if load_optim:
        _allocate_optimizer_states(optimizer)
    state = _sharded_state_dict(model, optimizer, is_loading=True, save_optim=load_optim)
    try:
        loaded = dcp.load(state, directory)
    except Exception as exc:  # noqa: BLE001 -- megatron-core's, naming the tensors
        if not foreign:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StartupError(f"checkpoint {directory} (Megatron-LM's torch_dist) does not fit this "
                           f"run's model: {first}") from None
    if len(model) == 1:
        model[0].module.load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(model):
            chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    out = dict(common)
    out["optimizer_loaded"] = load_optim
    if load_optim:
        _load_optimizer(optimizer, loaded["optimizer"])
    if foreign:  # no per-rank state of ours; the data position is in Megatron-LM's args
        from megatron.training.checkpoint import megatron_lm_format
        from megatron.training.checkpoint.megatron_lm_format import train_state_of

        out.update(same_layout=True, train_state=train_state_of(saved_args))
        log(f" > loaded the model weights of {directory} (Megatron-LM's torch_dist, written with "
            f"TP={getattr(saved_args, 'tensor_model_parallel_size', '?')}, "
            f"PP={getattr(saved_args, 'pipeline_model_parallel_size', '?')}, resharded to this "
            f"run's layout; " + ("iteration 0" if finetune else
                                 f"iteration {common.get('iteration')}, optimizer and RNG freshly "
                                 f"initialized, {megatron_lm_format.SCHEDULE_NOTE}") + ")")
        return out

    layout = run_layout()
    per_rank, same, problem = {}, False, None
    try:
        per_rank, same = _per_rank_state(directory, layout, saved_args)
    except checkpoint_integrity.CheckpointIntegrityError as exc:
        problem = str(exc)
    # every rank stops, not only the one whose file is missing or damaged
    raise_if_any_rank_failed(problem, collective_device())
    out["same_layout"] = same
    if not same:
        old = per_rank.get("layout") or {}
        log(f" > checkpoint {directory} was written with TP={_get(saved_args, 'tensor_model_parallel_size')}"
            f", PP={_get(saved_args, 'pipeline_model_parallel_size')}, "
            f"DP={_get(saved_args, 'data_parallel_size')}, "
            f"EP={_get(saved_args, 'expert_model_parallel_size') or 1}; this run has "
            f"TP={layout['tp']}, PP={layout['pp']}, DP={layout['dp']}, EP={layout['ep']}: model "
            "and optimizer states resharded"
            + ("; RNG states from DP rank 0" if old else "; RNG states not restored (no rank "
               "of the same TP/PP layout in the checkpoint)"))
    if "rng_state" in per_rank:
        out["rng_state"] = per_rank["rng_state"]
    if per_rank.get("quantization"):
        out["quantization"] = per_rank["quantization"]
    return out


def _check_foreign(directory: str, common: Dict[str, Any], args: argparse.Namespace,
                   finetune: bool) -> Optional[str]:
    """Why a torch_dist checkpoint of Megatron-LM cannot load into this run (None when it can):
    its optimizer and RNG states are Megatron-LM's (the flags must say they are not wanted), and
    its architecture must be this run's (resharding handles TP/PP, not another model)."""
    from megatron.training.checkpoint import megatron_lm_format

    problem = megatron_lm_format.flags_problem(directory, common.get("iteration"), args, finetune,
                                               layout="Megatron-LM's torch_dist format")
    diffs = megatron_lm_format.architecture_diff(common.get("args"), args)
    if problem is None and diffs:
        problem = (f"checkpoint {directory} (Megatron-LM's torch_dist) holds another model: "
                   f"{'; '.join(diffs)}")
    return problem


def _allocate_optimizer_states(optimizer: Any) -> None:
    """Give a fresh distributed optimizer its Adam states before a sharded load.

    Why: without Apex/TE, megatron-core 0.16.1's ``DistributedOptimizer.state_dict()`` (which its
    ``sharded_state_dict(is_loading=True)`` calls) asserts one common ``step`` over existing
    states, and a new optimizer has none.  megatron-core's own remedy (used by its
    ``fully_sharded_model_space`` path) is one optimizer step on zero gradients; every value it
    writes is then overwritten by the load (master weights and moments, step from the param
    groups)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.distributed.mcore_compat.optimizer import \
        init_optimizer_states_with_dummy_values

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            init_optimizer_states_with_dummy_values(opt)


def _load_optimizer(optimizer: Any, state: Any) -> None:
    """``optimizer.load_state_dict`` for the loaded sharded state, chained or not."""
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    states = [state] if len(subs) == 1 else [v for _, v in sorted(state.items())]
    for opt, sd in zip(subs, states):
        _load_one_optimizer(opt, sd)


def _load_one_optimizer(opt: Any, sd: Dict[str, Any]) -> None:
    """Load one (distributed) optimizer's state.

    Why not ``opt.load_state_dict(sd)`` alone: megatron-core 0.16.1's
    ``load_parameter_state_from_fully_reshardable`` copies every key of the torch optimizer's
    per-parameter state from the checkpoint, including torch Adam's ``step``, which that format
    (correctly) keeps in the param groups instead -- a ``KeyError: 'step'`` without Apex/TE.
    So the param groups, ``step`` and grad scaler are loaded first, and the parameter states with
    ``step`` set aside; every parameter gets its own ``step`` tensor back."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(opt, DistributedOptimizer) or sd.get("param_state_sharding_type") != \
            OPTIMIZER_SHARDING:
        opt.load_state_dict(sd)
        return
    sd = dict(sd)
    param_state = sd.pop("param_state")
    sd.pop("param_state_sharding_type")
    opt.load_state_dict(sd)
    steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
    opt.load_parameter_state_from_fully_reshardable(param_state)
    for p, step in steps.items():
        opt.optimizer.state[p]["step"] = step.detach().clone()


def read_common_state(dcp: Any, directory: str) -> Dict[str, Any]:
    """megatron-core's common state (``common.pt``) of a torch_dist checkpoint, after a check of
    its ``metadata.json``: a damaged one of either (with ``--no-verify-checkpoint``, or no
    manifest) is one :class:`~.checkpoint_integrity.CheckpointIntegrityError` naming the file,
    not megatron-core's traceback naming none."""
    metadata = os.path.join(directory, "metadata.json")
    try:
        with open(metadata, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as exc:
        raise checkpoint_integrity.CheckpointIntegrityError(checkpoint_integrity.damaged(
            directory, metadata, f"cannot be read ({exc})")) from None
    try:
        return dcp.load_common_state_dict(directory)
    except Exception as exc:  # noqa: BLE001 -- torch's zip reader, pickle, megatron-core's own
        raise checkpoint_integrity.unreadable(
            directory, os.path.join(directory, "common.pt"), exc) from None


def _saved_top_keys(dcp: Any, directory: str) -> set:
    """Top-level keys of the sharded tensors in a checkpoint (to know whether it has optimizer
    state without failing on a missing key)."""
    try:
        metadata = dcp.load_tensors_metadata(directory)
    except Exception as exc:  # noqa: BLE001 -- a damaged .metadata: name it
        raise checkpoint_integrity.unreadable(
            directory, os.path.join(directory, ".metadata"), exc) from None
    return {key.split(".", 1)[0] for key in metadata}


PER_RANK_ARGS = ("rank", "local_rank")
"""Args that differ between ranks: left out of the common state, which megatron-core checks is
the same on every rank (it warns otherwise)."""


def _plain_args(args: argparse.Namespace) -> Dict[str, Any]:
    """The run's flags as plain values (objects such as dtypes become their string)."""
    plain = (int, float, str, bool, type(None))
    return {k: v if isinstance(v, plain) else str(v) for k, v in vars(args).items()
            if k not in PER_RANK_ARGS}


def _get(saved_args: Any, name: str) -> Any:
    return saved_arg(saved_args, name, "?")
