export PYTHONPATH=$PWD
timeout 150 python -m pytest -q -x tests/test_gpu_engine.py tests/test_gpu_callback.py tests/test_memory_picture.py tests/test_tracing.py -m gpu 2>&1 | tail -4
python3 -m benchmarks --workloads llama1b-s4k --modes none,ac,ours-default,ours-budget-0.9x,ours-budget-0.7x,ours-budget-floor --steps 4 --device-name h200-v13-s4k --deadline 100 --out $OUT 2>&1 | grep -v "^\[" | grep -E "llama1b-s4k |B1|B2|B4|B5"
python3 -m benchmarks --workloads llama8b-lora-s8k --modes none,ac,ours-default,budget-16G,ours-budget-0.9x,ours-budget-0.7x --steps 3 --device-name h200-v13-8b --deadline 230 --out $OUT 2>&1 | grep -v "^\[" | grep -E "llama8b-lora-s8k |B1|B2|B4|B5"
python3 - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/*.json")):
    for w in json.load(open(f))["results"]:
        for r in w["rows"]:
            if r.get("status")!="ok": print(r["mode"], r.get("oom_step"), str(r.get("oom_error"))[:300])
            if "plan" in r and r["plan"]: print(r["mode"], {k: r["plan"].get(k) for k in ("offload_bytes","checkpoint_blocks","peak","extra_ms","fits")}, "fwd/bwd", round(r.get("fwd_s",0)*1e3), round(r.get("bwd_s",0)*1e3), {k: round(v,1) for k,v in (r.get("engine") or {}).items() if "ms" in k})
P
rm -f $OUT/*.png
