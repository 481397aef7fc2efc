#!/usr/bin/env bash
# SLURM template: one SDP4Bit recipe as an elastic, requeueable job.
#
#   sbatch examples/sdp4bit/sbatch_elastic.sh [extra pretrain_gpt.py args]
#   RECIPE=run_350m.sh VARIANT=sdp4bit sbatch --nodes 8 examples/sdp4bit/sbatch_elastic.sh
#
# What survives what:
# * a worker that dies (or a node that leaves): torchrun (ELASTIC=1: c10d rendezvous,
#   --max-restarts) restarts every worker, on the nodes still there when at least MIN_NNODES
#   remain; they resume from the last torch_dist checkpoint (resharded when DP changed; the
#   global batch is kept). Each attempt rendezvouses in a key space of its own and takes over
#   the --save lock of the attempt before it, on any host.
# * preemption or a node failure SLURM acts on: --requeue runs the job again (same
#   SLURM_JOB_ID, SLURM_RESTART_COUNT + 1), which resumes from the same --save.
# ECHO_ONLY=1 bash examples/sdp4bit/sbatch_elastic.sh prints the srun line and the torchrun line
# each node would run, without running either.
#
#SBATCH --job-name=sdp4bit-elastic
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=runs/slurm-%x-%j.out
set -euo pipefail

HERE=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}/examples/sdp4bit
RECIPE=${RECIPE:-run_1.3b.sh}
[[ -f "$HERE/$RECIPE" ]] || { echo "[sbatch] error: RECIPE=$RECIPE: no $HERE/$RECIPE" >&2; exit 2; }

export ELASTIC=1
export NNODES=${NNODES:-${SLURM_NNODES:-2}}
export MIN_NNODES=${MIN_NNODES:-$(( NNODES > 1 ? NNODES / 2 : 1 ))}
export MAX_RESTARTS=${MAX_RESTARTS:-3}
export MASTER_PORT=${MASTER_PORT:-29500}
# one rendezvous id for every node of this job, and the same after a requeue
export RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-sdp4bit-elastic}}

# one task per node; a node that fails must not end the step on the others (torchrun's
# rendezvous carries on without it), and nothing kills the step for one task's exit status
SRUN=(srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 bash "$HERE/$RECIPE" "$@")
echo "[sbatch] ${SRUN[*]}" >&2
if [[ "${ECHO_ONLY:-0}" == 1 ]]; then
    printf '%s\n' "${SRUN[*]}"
    bash "$HERE/$RECIPE" "$@"   # the torchrun line (ECHO_ONLY=1 is passed on)
    exit 0
fi
exec "${SRUN[@]}"
