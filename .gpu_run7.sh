export PYTHONPATH=$PWD
python3 -m benchmarks --workloads small-h512 --modes none,ac,ours-default,ours-budget-0.9x,ours-budget-0.7x --steps 4 --device-name h200-v11-small --deadline 60 --out $OUT 2>&1 | grep -v "^\[" | tail -14
python3 -m benchmarks --workloads llama1b-s4k --modes none,ac+offload,ours-budget-floor --steps 4 --device-name h200-v11-floor --deadline 60 --out $OUT 2>&1 | grep -v "^\[" | tail -6
python3 - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/*.json")):
    for w in json.load(open(f))["results"]:
        for r in w["rows"]:
            if r.get("status")!="ok": print(r["mode"], r.get("oom_step"), r.get("oom_error"))
P
rm -f $OUT/*.png
