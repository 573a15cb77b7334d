# Sourced by every tutorial page: the project's virtualenv and a small, quick setting.
# shellcheck disable=SC2034
source .venv/bin/activate
# 300 train + 40 val conversations, 6 optimizer steps, 5 eval questions: each command takes
# seconds to a minute on a laptop CPU. Drop these overrides for the full default run.
TUTORIAL="work_dir=runs/tutorial data.num_train=300 data.num_val=40 prepare.num_workers=1 train.max_steps=6 train.save_every=2 train.eval_samples=5"
