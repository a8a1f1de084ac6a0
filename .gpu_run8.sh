export PYTHONPATH=$PWD
timeout 60 python -m pytest -q -x tests/test_gpu_engine.py -m gpu -k "budget" 2>&1 | tail -1
python3 -m benchmarks --workloads small-h512 --modes none,ac,ac+offload,ours-budget-0.9x,ours-budget-0.7x,ours-budget-floor --steps 4 --device-name h200-v12-small --deadline 50 --out $OUT 2>&1 | grep -v "^\[" | grep -E "small-h512 |B1|B2|B5"
python3 -m benchmarks --workloads llama1b-s4k --modes none,ac,ac+offload,ours-budget-0.9x,ours-budget-0.7x,ours-budget-floor --steps 4 --device-name h200-v12-s4k --deadline 90 --out $OUT 2>&1 | grep -v "^\[" | grep -E "llama1b-s4k |B1|B2|B5"
python3 - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/*.json")):
    for w in json.load(open(f))["results"]:
        for r in w["rows"]:
            if r.get("status")!="ok": print(r["mode"], r.get("oom_step"), str(r.get("oom_error"))[:300])
            if "plan" in r: print(r["mode"], {k: r["plan"][k] for k in ("offload_bytes","checkpoint_blocks","peak","extra_ms","fits")})
P
rm -f $OUT/*.png
