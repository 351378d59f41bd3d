#!/usr/bin/env bash
# docs/evidence.md, round two (issue #54): every bold conclusion re-run on a second, disjoint set of ten seeds
# (10-19; the documented runs used 0-9), only the arms its comparison needs, each from its own spec in
# configs/sweeps/ (tether sweep --seeds --arms). Then the new questions' sweeps (long regime, LoRA, normalization)
# when their specs exist. One sweep at a time, one lane (two CPU-heavy processes at once run 5-10x slower); every
# sweep resumes where it stopped, so the script can be run again after a kill, in this session or the next.
#
#   bash scripts/evidence_round2.sh            # all, in order
#   bash scripts/evidence_round2.sh anchors    # one of: staleness_sync staleness_async anchors trust_regions
#                                              #         recipes agent_lr long lora normalization smollm2_lora
#
# Sweep directories go to $SWEEPS (default sweeps/); reports are written by docs/evidence.md's commands.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
T="${TETHER:-$root/.venv/bin/tether}"
out="${SWEEPS:-$root/sweeps}"
lanes="${LANES:-1}"
rep="--seeds 10-19"

run() {  # NAME SPEC [tether sweep options...]
  local name=$1 spec=$2; shift 2
  echo "[round2] $name: $(date '+%H:%M:%S')"
  "$T" sweep "configs/sweeps/$spec.yaml" --out "$out/$name" --lanes "$lanes" "$@"
  echo "[round2] $name: exit $? at $(date '+%H:%M:%S')"
}

sel="$*"
has() { [ -z "$sel" ] || [[ " $sel " == *" $1 "* ]]; }

# 1. staleness: K0 vs K1 (TIS + IcePop) at 3e-5; K0, K1 uncorrected, K1 corrected at 2e-4; K = 4 with and without
#    the ESS step, and uncorrected
has staleness_sync && run rep_staleness_sync evidence_staleness_sync $rep
has staleness_async && run rep_staleness_async evidence_staleness_async $rep \
  --arms "K1+icepop+lr=3.0e-05,K1+none+lr=0.0002,K1+icepop+lr=0.0002,K4_none_lr=0.0002,K4_icepop_lr=0.0002,K4_icepop_ess_lr=0.0002"
# 2. anchors at 5x the learning rate: none, fixed, EMA 0.5 (beta 0.1); iterative at both betas
has anchors && run rep_anchors evidence_anchors $rep \
  --arms "none_lr=0.00015,fixed+beta=0.1+lr=0.00015,ema50+beta=0.1+lr=0.00015,iterative+beta=0.1+lr=0.00015,iterative+beta=0.01+lr=0.00015"
# 4. trust regions at lr 1e-4 against none
has trust_regions && run rep_trust_regions_edge evidence_trust_regions_edge $rep
# 5. recipes: dapo, gspo, cispo against grpo at 1.5e-4; cispo against grpo at 3e-5
has recipes && run rep_recipes evidence_recipes $rep \
  --arms "grpo+lr=0.00015,dapo+lr=0.00015,gspo+lr=0.00015,cispo+lr=0.00015,grpo+lr=3.0e-05,cispo+lr=3.0e-05"
# 6. the agent task at 5x the learning rate: ema_pg (and its fixed anchor) against grpo, training reward
has agent_lr && run rep_agent_lr evidence_agent_lr $rep
# the new questions (their specs hold their own seeds)
for s in long lora normalization; do
  if has "$s" && [ -f "configs/sweeps/evidence_$s.yaml" ]; then run "$s" "evidence_$s"; fi
done
# ... and their second sets, and the arms that followed from the first (docs/evidence.md gives each report's command)
if has long; then
  run long_beta evidence_long_beta --seeds 2-9      # seeds 0 and 1: pilot_long_beta.yaml's runs
  run long_beta2 evidence_long_beta $rep
  run long2 evidence_long --arms none $rep
  run long_beta_anchors evidence_long_beta_anchors
fi
has lora && run lora2 evidence_lora $rep --arms "full_lr=1.0e-05,r1_lr=1.0e-04,r8_lr=1.0e-04,r64_lr=1.0e-04"
if has normalization; then
  run normalization2 evidence_normalization $rep --arms "grpo+token-mean+lr=0.00015,grpo+seq-mean-token-mean+lr=0.00015,reinforce_pp_baseline+seq-mean-token-mean+lr=0.00015,dr_grpo+seq-mean-token-mean+lr=0.00015,grpo+token-mean+lr=3.0e-05,dr_grpo+seq-mean-token-mean+lr=3.0e-05"
  run normalization_ema_pg evidence_normalization_ema_pg
  run normalization_ema_pg2 evidence_normalization_ema_pg $rep
fi
# LoRA on SmolLM2-135M, five seeds an arm (23-30 CPU minutes a run): rank 1 at 10x; the full arm's seed 0 re-run (it
# must reproduce the committed synchronous run of docs/evidence/smollm2_runs, whose finals the comparison pairs);
# the two-seed pilot at 30x. Then (with the default $SWEEPS):
#   python scripts/smollm2_lora_pairs.py sweeps/smollm2_lora --rerun sweeps/smollm2_lora_full
if has smollm2_lora; then
  run smollm2_lora evidence_smollm2_lora --arms r1_lr=1.0e-04
  run smollm2_lora_full evidence_smollm2_lora --arms full_lr=1.0e-05 --seeds 0-0
  run smollm2_lora_pilot evidence_smollm2_lora --arms r1_lr=3.0e-04 --seeds 0-1
fi
