#!/usr/bin/env bash
# The corruption table: what `opd train --resume` does with a damaged or tampered run directory.
# One tiny run (checkpoints step_1 and step_2), then each damage on a copy of it, resumed.
#   scripts/hardening/corruption_table.sh [WORK_DIR]      (default: a new temporary directory)
set -u
cd "$(dirname "$0")/../.."
T="${1:-$(mktemp -d)}"; mkdir -p "$T"
C="student.bootstrap.cache_dir=$T/cache teacher.bootstrap.cache_dir=$T/cache"
echo "work directory: $T"
.venv/bin/opd train tests/data/tiny.yaml run.output_dir="$T/base" $C > "$T/base.log" 2>&1 || { echo "the base run failed: $T/base.log"; exit 1; }
case_run() {  # NAME DAMAGE [OVERRIDES...]: DAMAGE runs inside the copy's checkpoints/step_2
  local name=$1 damage=$2; shift 2
  rm -rf "${T:?}/$name"; cp -r "$T/base" "$T/$name"
  (cd "$T/$name/checkpoints/step_2" && eval "$damage")
  COLUMNS=400 .venv/bin/opd train tests/data/tiny.yaml run.output_dir="$T/$name" $C run.total_steps=3 "$@" --resume \
    > "$T/$name.log" 2>&1
  echo "=== $name: exit $?"
  grep -E "skipped|resumed|error|last complete|resume with" "$T/$name.log" | sed 's/^\[[0-9:]*\] *//; s/ *driver.py:[0-9]*$//' | cut -c1-400
}
here="$PWD"
half='truncate -s $(( $(stat -c%s "$f") / 2 )) "$f"'
case_run truncated_model_states "f=\$(ls ds/state/*model_states.pt | head -1); $half"
case_run missing_optimizer 'rm ds/state/*optim_states.pt'
case_run truncated_hf_export "f=hf/model.safetensors; $half"
case_run complete_empty_object 'echo "{}" > COMPLETE'
case_run complete_empty_list 'echo "[]" > COMPLETE'
case_run changed_recipe 'true' trainer.learning_rate=3e-3 rollout.temperature=0.7
case_run crafted_pickle_forged_manifest "$here/.venv/bin/python $here/scripts/hardening/craft_pickle.py . $T/EXPLOITED forge"
case_run crafted_pickle "$here/.venv/bin/python $here/scripts/hardening/craft_pickle.py . $T/EXPLOITED keep"
case_run all_damaged 'echo "{}" > COMPLETE; echo "[]" > ../step_1/COMPLETE'
if [ -e "$T/EXPLOITED" ]; then echo "THE CRAFTED PICKLE RAN"; exit 1; else echo "the crafted pickle never ran"; fi
