"""Megatron-LM's own ``torch`` checkpoint layout, read for its model weights.

Layout of one iteration folder (``iter_NNNNNNN/`` or ``release/``), as Megatron-LM's
``save_checkpoint`` and its converter write it::

    mp_rank_{tp:02d}/model_optim_rng.pt             # pipeline-parallel size 1
    mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt    # pipeline-parallel size > 1

Why a module of its own: this is not our ``torch`` format (:mod:`.torch_format`), and only the
weights carry over (Megatron-LM's optimizer and RNG states are laid out by its classes): it loads
with ``--finetune`` or ``--no-load-optim --no-load-rng``, its LR schedule through
:func:`~megatron.training.lr_schedule.load_scheduler_state`. What does not fit this run is refused
in one line naming it; TE's fused layer-norm names are mapped to this run's spec; no manifest, so
no digest verification (:data:`UNVERIFIED_NOTE`). See "Checkpoints" in docs/architecture.md.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron.training.checkpoint import integrity as checkpoint_integrity
from megatron.training.checkpoint.discovery import LoadTarget, stop_if_any_rank_failed
from megatron.training.checkpoint.layout import MEGATRON_LM_MODEL_FILE as MODEL_FILE
from megatron.training.checkpoint.layout import saved_arg
from megatron.training.errors import StartupError
from megatron.training.model.layer_specs import canonical_layer_key

LAYOUT_NAME = "Megatron-LM's torch layout"
UNVERIFIED_NOTE = (" > checkpoint {path} was written by Megatron-LM, not by this trainer: it "
                   "has no " + checkpoint_integrity.MANIFEST + ", so its files are loaded "
                   "without digest verification")
"""The log line of a load without verification (``{path}``: the iteration folder)."""
SCHEDULE_NOTE = ("learning-rate schedule continued at the checkpoint's consumed samples (next "
                 "line)")
"""What a load that continues at the checkpoint's iteration says of the schedule
(:func:`~megatron.training.lr_schedule.resume_schedule` logs how)."""

_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_OUR_FILE = re.compile(r"mp_rank_\d+_\d+_dp_\d+\.pt$")
_LAYER_KEY = re.compile(r"(decoder\.layers\.\d+\.)(.+)$")

ARCHITECTURE_FLAGS = (
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"), ("num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "--num-query-groups"), ("kv_channels", "--kv-channels"),
    ("padded_vocab_size", "padded vocabulary size (--make-vocab-size-divisible-by x "
                          "--tensor-model-parallel-size)"), ("swiglu", "--swiglu"),
    ("normalization", "--normalization"), ("position_embedding_type", "--position-embedding-type"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("add_bias_linear", "add_bias_linear (--disable-bias-linear)"),
    ("add_qkv_bias", "--add-qkv-bias"),
    ("qk_layernorm", "--qk-layernorm"),
    ("apply_layernorm_1p", "--apply-layernorm-1p"),   # same tensors, another meaning
    # same tensors, another function: a checkpoint loaded with other values trains wrongly
    ("rotary_base", "--rotary-base"), ("rotary_percent", "--rotary-percent"),
    ("rotary_interleaved", "--rotary-interleaved (not supported here)"),
    ("use_rope_scaling", "--use-rope-scaling"), ("rope_scaling_factor", "--rope-scaling-factor"),
    ("norm_epsilon", "--norm-epsilon"), ("openai_gelu", "--openai-gelu"),
    ("squared_relu", "--squared-relu (not supported here)"),
)
"""Saved args that decide the model's tensors (or how the attention heads split them) or what
the model computes with them, in Megatron-LM's names, with the flag a difference is named by."""

NAMES_HERE = {"norm_epsilon": ("norm_epsilon", "layernorm_epsilon")}
"""Where an :data:`ARCHITECTURE_FLAGS` setting is kept under other names (the first one set is
taken): Megatron-LM's ``norm_epsilon`` is this trainer's ``layernorm_epsilon``."""
NOT_SUPPORTED_HERE = {"rotary_interleaved": False, "squared_relu": False}
"""Megatron-LM settings this trainer has no flag for, with what its model does: a checkpoint
that records another value is refused rather than loaded into another function."""
ROPE_ONLY = ("rotary_base", "rotary_percent", "rotary_interleaved", "use_rope_scaling",
             "rope_scaling_factor")
"""Settings compared only when both sides use --position-embedding-type rope."""


# ----------------------------------------------------------------------------- detection
def rank_dirs(path: str) -> Dict[Tuple[int, int], str]:
    """``(tp_rank, pp_rank) -> folder name`` of the ``mp_rank_*`` folders holding
    :data:`MODEL_FILE` (empty for anything else)."""
    out: Dict[Tuple[int, int], str] = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for name in names:
        m = _RANK_DIR.match(name)
        if m and os.path.isfile(os.path.join(path, name, MODEL_FILE)):
            out[(int(m.group(1)), int(m.group(2) or 0))] = name
    return out


def is_megatron_lm_checkpoint(path: str) -> bool:
    """``path`` holds Megatron-LM's torch layout and nothing of ours (a manifest, our per-rank
    files or torch_dist's metadata): a damaged checkpoint of ours is never taken for one."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    ours = any(n in (checkpoint_integrity.MANIFEST, checkpoint_integrity.WRITER_NOTE,
                     "metadata.json") or _OUR_FILE.match(n) for n in names)
    return not ours and bool(rank_dirs(path))


def is_megatron_lm_torch_dist(path: str) -> bool:
    """``path`` looks like Megatron-LM's torch_dist (megatron-core's ``metadata.json``, none of
    our files: manifest, writer note, ``rank_state/``).  Only for what the log says: the load
    itself tells by the saved args (a Namespace; ours are a plain dict)."""
    try:
        names = set(os.listdir(path))
    except OSError:
        return False
    return "metadata.json" in names and not names & {
        checkpoint_integrity.MANIFEST, checkpoint_integrity.WRITER_NOTE, "rank_state"}


def saved_parallel_sizes(path: str) -> Tuple[int, int]:
    """(TP, PP) sizes the folder names say the checkpoint was written with."""
    ranks = rank_dirs(path)
    return (1 + max(tp for tp, _ in ranks), 1 + max(pp for _, pp in ranks))


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron-LM's folder of a (TP, PP) rank: the PP rank only when there is more than one."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")


# ----------------------------------------------------------------------------- reading
class _Unavailable:
    """Stands in for a class the checkpoint's pickle names that does not import here
    (Megatron-LM's own modules, held by its saved args): the weights never need them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Unavailable,), {"__module__": module})


def _lenient_load(f: Any, **kwargs: Any) -> Any:
    return _LenientUnpickler(f, **kwargs).load()


_LENIENT_PICKLE = types.ModuleType("megatron_lm_checkpoint_pickle")
"""``torch.load``'s ``pickle_module``: unknown classes become :class:`_Unavailable`."""
_LENIENT_PICKLE.Unpickler = _LenientUnpickler  # type: ignore[attr-defined]
_LENIENT_PICKLE.load = _lenient_load  # type: ignore[attr-defined]


def _architecture(ns: Any) -> Dict[str, Any]:
    """The :data:`ARCHITECTURE_FLAGS` values of ``ns``, defaults resolved as both trainers
    resolve them (query groups = heads without GQA; kv channels = hidden / heads)."""
    values = {}
    for name, _ in ARCHITECTURE_FLAGS:
        found = [saved_arg(ns, n) for n in NAMES_HERE.get(name, (name,))]
        values[name] = next((v for v in found if v is not None), None)
    heads, hidden = values["num_attention_heads"], values["hidden_size"]
    if not saved_arg(ns, "group_query_attention"):
        values["num_query_groups"] = heads
    if values["kv_channels"] is None and isinstance(heads, int) and isinstance(hidden, int) \
            and heads:
        values["kv_channels"] = hidden // heads
    return values


def architecture_diff(saved_args: Any, args: argparse.Namespace) -> List[str]:
    """``"--hidden-size 128 (this run: 64)"`` per architecture setting that differs (settings
    either side does not record are not compared, nor defaults derived from a setting already
    named)."""
    old, new = _architecture(saved_args), _architecture(args)
    for name, value in NOT_SUPPORTED_HERE.items():
        if new[name] is None:
            new[name] = value
    differ = {name for name, _ in ARCHITECTURE_FLAGS
              if old[name] is not None and new[name] is not None and old[name] != new[name]
              and not isinstance(old[name], _Unavailable)}
    if not (old["position_embedding_type"] == new["position_embedding_type"] == "rope"):
        differ.difference_update(ROPE_ONLY)
    if not (old["use_rope_scaling"] or new["use_rope_scaling"]):
        differ.discard("rope_scaling_factor")
    if old["swiglu"] and new["swiglu"]:   # SwiGLU's activation is SiLU either way
        differ.discard("openai_gelu")
    if differ & {"hidden_size", "num_attention_heads"}:
        differ.discard("kv_channels")
    if "num_attention_heads" in differ and not (saved_arg(saved_args, "group_query_attention")
                                                or saved_arg(args, "group_query_attention")):
        differ.discard("num_query_groups")
    return [f"{flag} {old[name]} (this run: {new[name]})" for name, flag in ARCHITECTURE_FLAGS
            if name in differ]


def _canonical(key: str) -> str:
    """A model key in one naming for both specs, without a Float16Module ``module.`` prefix."""
    if key.startswith("module."):
        key = key[len("module."):]
    m = _LAYER_KEY.match(key)
    return m.group(1) + canonical_layer_key(m.group(2)) if m else key


def _shape(value: Any) -> Optional[Tuple[int, ...]]:
    return tuple(value.shape) if torch.is_tensor(value) else None


def _listed(keys: List[str], n: int = 3) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def match_state_dict(saved: Dict[str, Any], model_sd: Dict[str, Any],
                     check_shapes: bool = True) -> Tuple[Dict[str, Any], List[str], List[str]]:
    """``saved`` (a checkpoint's model state dict) in the names of ``model_sd`` (this run's
    ``state_dict(keep_vars=True)``).  Returns (state dict to load, problems, notes).

    Keys match after :func:`_canonical` (TE's fused layer-norm names = the local spec's);
    ``_extra_state`` entries take the checkpoint's value where this run's layer has the entry,
    this run's own otherwise, and checkpoint entries no layer here has are left out (a note
    when they hold something).  Problems: tensors missing or left over, other shapes, two
    checkpoint keys for one weight."""
    problems: List[str] = []
    by_canon: Dict[str, str] = {}
    for key in saved:
        canon = _canonical(key)
        if canon in by_canon:
            problems.append(f"both {by_canon[canon]} and {key} name {canon}")
        by_canon[canon] = key
    mapped: Dict[str, Any] = {}
    missing, shapes, renamed, used = [], [], 0, set()
    for key, own in model_sd.items():
        canon = _canonical(key)
        src = by_canon.get(canon)
        if key.endswith("_extra_state"):
            mapped[key] = saved[src] if src is not None else own
            used.add(canon)
            continue
        if src is None or not torch.is_tensor(saved[src]):
            missing.append(key)
            continue
        used.add(canon)
        renamed += (src[len("module."):] if src.startswith("module.") else src) != key
        if check_shapes and _shape(own) is not None and _shape(saved[src]) != _shape(own):
            shapes.append(f"{key} {list(saved[src].shape)} (this run: {list(own.shape)})")
        mapped[key] = saved[src]
    extra = [by_canon[c] for c in by_canon if c not in used]
    unexpected = [k for k in extra if not k.endswith("_extra_state")]
    dropped = [k for k in extra if k.endswith("_extra_state") and _holds_something(saved[k])]
    if missing:
        problems.append(f"{len(missing)} tensor(s) of this run's model are not in it "
                        f"({_listed(missing)})")
    if unexpected:
        hint = (" -- a legacy Megatron-LM model, not megatron-core's GPTModel: convert it to "
                "a megatron-core model (convert.py --saver core / mcore)"
                if any(k.startswith("language_model.") for k in unexpected) else "")
        problems.append(f"{len(unexpected)} tensor(s) of it are not in this run's model "
                        f"({_listed(unexpected)}){hint}")
    if shapes:
        problems.append(f"other shapes: {_listed(shapes)}")
    notes = []
    if renamed:
        notes.append(f"{renamed} Transformer Engine layer-norm name(s) mapped to this run's spec")
    if dropped:
        notes.append(f"{len(dropped)} Transformer Engine _extra_state entr(ies) (FP8 scaling "
                     f"state) left out: this run's layers have none")
    return mapped, problems, notes


def _holds_something(value: Any) -> bool:
    """An ``_extra_state`` value with content (TE writes an empty buffer without FP8)."""
    if value is None:
        return False
    if torch.is_tensor(value):
        return value.numel() > 0
    if hasattr(value, "getbuffer"):
        return value.getbuffer().nbytes > 0
    return True


def flags_problem(directory: str, iteration: Any, args: argparse.Namespace, finetune: bool,
                  layout: str = f"{LAYOUT_NAME} (mp_rank_XX/{MODEL_FILE})") -> Optional[str]:
    """Why the run cannot load this checkpoint of Megatron-LM with its flags (None when it
    can): only the weights carry over, and the user must say whether the run restarts at 0 or
    continues."""
    if finetune or (getattr(args, "no_load_optim", False) and getattr(args, "no_load_rng", False)):
        return None
    return (f"checkpoint {directory} is in {layout}: its optimizer and RNG states are "
            "Megatron-LM's and are not read by this trainer. Load its model weights with "
            "--finetune (training starts at iteration 0) or with --no-load-optim --no-load-rng "
            f"(training continues at iteration {iteration})")


def read_rank_state(target: LoadTarget, args: argparse.Namespace, model: List[torch.nn.Module]
                    ) -> Tuple[List[Dict[str, Any]], Dict[str, Any], List[str]]:
    """This rank's (TP, PP) file: (state dict per model chunk in this run's names, the file's
    other entries, notes).  :class:`StartupError` in one line naming what does not fit."""
    from megatron.core import parallel_state as ps

    ckpt = target.directory
    where = f"checkpoint {ckpt} ({LAYOUT_NAME})"
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    saved_tp, saved_pp = saved_parallel_sizes(ckpt)
    layout = [f"--tensor-model-parallel-size {saved_tp} (this run: {tp})"] if saved_tp != tp \
        else []
    if saved_pp != pp:
        layout.append(f"--pipeline-model-parallel-size {saved_pp} (this run: {pp})")
    if layout:
        raise StartupError(
            f"{where} was written with {'; '.join(layout)}: it loads only into the same "
            "TP/PP layout. Run with that layout, or convert it with Megatron-LM's "
            f"tools/checkpoint/convert.py --target-tensor-parallel-size {tp} "
            f"--target-pipeline-parallel-size {pp}")
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    path = os.path.join(ckpt, rank_dir_name(tp_rank, pp_rank, pp), MODEL_FILE)
    if not os.path.isfile(path):
        raise checkpoint_integrity.CheckpointIntegrityError(checkpoint_integrity.damaged(
            ckpt, path, f"is missing (the file of TP rank {tp_rank}, PP rank {pp_rank})",
            target.load_flag))
    state = checkpoint_integrity.torch_load(path, ckpt, target.load_flag, map_location="cpu",
                                            weights_only=False, pickle_module=_LENIENT_PICKLE)
    if not isinstance(state, dict):
        raise StartupError(f"{where}: {path} holds a {type(state).__name__}, not a state dict")
    saved_args = state.get("args")
    ep = saved_arg(saved_args, "expert_model_parallel_size")
    if isinstance(ep, int) and ep > 1:
        raise StartupError(f"{where} was written with --expert-model-parallel-size {ep}: expert "
                           "parallel (MoE) checkpoints are not read")
    diffs = architecture_diff(saved_args, args)
    if diffs:
        raise StartupError(f"{where} holds another model: {'; '.join(diffs)}")
    names = ["model"] if "model" in state else sorted(
        (k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if len(names) != len(model):
        found = ", ".join(names) or "no 'model' entry"
        raise StartupError(f"{where}: {path} holds {len(names)} model chunk(s) ({found}"
                           f"{': virtual pipeline stages' if len(names) > 1 else ''}), this run "
                           f"has {len(model)}")
    chunks, notes = [], []
    for chunk, name in zip(model, names):
        engine = hasattr(chunk, "load_host_state_dict")  # PaRO: its parameters are shards
        mapped, problems, chunk_notes = match_state_dict(
            state[name], chunk.module.state_dict(keep_vars=True), check_shapes=not engine)
        if problems:
            raise StartupError(f"{where} does not fit this run's model: {'; '.join(problems)} "
                               f"(in {os.path.relpath(path, ckpt)}, entry '{name}')")
        chunks.append(mapped)
        notes += chunk_notes
    rest = {k: v for k, v in state.items() if k not in names}
    return chunks, rest, sorted(set(notes))


def train_state_of(saved_args: Any) -> Dict[str, int]:
    """The data position Megatron-LM keeps in its args, in our train_state's keys."""
    out = {}
    for name in ("consumed_train_samples", "consumed_valid_samples"):
        value = saved_arg(saved_args, name)
        if isinstance(value, int):
            out[name] = value
    return out


def load(target: LoadTarget, args: argparse.Namespace, model: List[torch.nn.Module],
         finetune: bool, log: Callable[[str], None]) -> Dict[str, Any]:
    """Collective: load the weights of a checkpoint in Megatron-LM's torch layout into
    ``model``.  Every rank reads its file and checks it first; a problem on any rank stops every
    rank with that rank's line.  Returns ``args`` and ``train_state`` (the data position, when
    the run continues at the checkpoint's iteration) -- never optimizer or RNG state."""
    from megatron.distributed.quant import integration

    chunks, rest, notes = [], {}, []
    problem = flags_problem(target.directory, target.iteration, args, finetune)
    if problem is None:
        try:
            chunks, rest, notes = read_rank_state(target, args, model)
        except StartupError as exc:
            problem = str(exc)
    stop_if_any_rank_failed(problem)
    for chunk, sd in zip(model, chunks):
        integration.load_model_state_dict(chunk, sd)
    from megatron.core import parallel_state as ps

    saved_args = rest.get("args")
    # read_rank_state refused any other layout: the checkpoint's TP/PP are this run's
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    how = ("a release checkpoint: iteration 0, as with --finetune" if target.release else
           "--finetune: iteration 0" if finetune else
           f"iteration {target.iteration}, optimizer and RNG freshly initialized, "
           f"{SCHEDULE_NOTE}")
    log(f" > loaded the model weights of {target.directory} ({LAYOUT_NAME}, TP={tp}, PP={pp}, "
        f"checkpoint_version {rest.get('checkpoint_version', '?')}; {how})"
        + "".join(f"; {n}" for n in notes))
    out = {"args": saved_args, "train_state": {} if finetune else train_state_of(saved_args)}
    for key in ("opt_param_scheduler", "lr_scheduler"):   # a plain dict: the schedule resumes
        if key in rest and not finetune:
            out[key] = rest[key]
    return out
