export PYTHONPATH=$PWD
timeout 60 python -m pytest -q -x tests/test_gpu_engine.py -m gpu -k "budget" 2>&1 | tail -1
python3 -m benchmarks --workloads llama1b-s4k --modes none,ac,ac+offload,ours-budget-0.9x,ours-budget-0.7x,ours-budget-floor --steps 4 --device-name h200-v16-s4k --deadline 80 --out $OUT 2>&1 | grep -v "^\[" | grep -E "llama1b-s4k |B1|B2|B5"
python3 -m benchmarks --workloads llama8b-lora-s8k --modes none,ac,budget-16G,ours-budget-0.9x,ours-budget-0.7x,ours-budget-0.5x --steps 3 --device-name h200-v16-8b --deadline 170 --out $OUT 2>&1 | grep -v "^\[" | grep -E "llama8b-lora-s8k |B1|B2|B5"
python3 -m benchmarks --capacity --capacity-models smallvocab-h1024 --caps 8 --modes ours-budget,ac --steps 4 --max-seq 98304 --device-name h200-v16-cap-small --deadline 150 --out $OUT 2>&1 | grep -v "^\[" | tail -6
python3 - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/*.json")):
    d=json.load(open(f))
    for w in d.get("results",[]):
        for r in w["rows"]:
            if r.get("status")!="ok": print(r["mode"], r.get("status","")[:80], r.get("oom_step"), str(r.get("oom_error"))[:200])
            if r.get("plan"): print(r["mode"], {k: r["plan"].get(k) for k in ("offload_bytes","checkpoint_blocks","peak","extra_ms")}, "prof", r["profile"]["peak"], r["profile"]["eligible"], "fwd/bwd", round(r.get("fwd_s",0)*1e3), round(r.get("bwd_s",0)*1e3), {k: round(v,1) for k,v in (r.get("engine") or {}).items() if "ms" in k})
    for c in d.get("capacity",[]):
        for s in c.get("searches",[]):
            print(c["model"]["name"], c["cap_gib"], s["mode"], s.get("longest"), s.get("stopped"), [(p['seq'],p['fits'],round(p['wall_s'],1), (p.get('note') or '')[:40], p.get('step_s') and round(p['step_s'],3)) for p in s.get('probes',[])])
P
rm -f $OUT/*.png
