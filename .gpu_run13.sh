export PYTHONPATH=$PWD
python3 -m benchmarks --capacity --capacity-models smallvocab-h1024 --caps 8 --modes ours-budget,ac --steps 8 --max-seq 47104 --device-name h200-v16-cap-small-steady --deadline 190 --out $OUT 2>&1 | grep -v "^\[" | tail -6
python3 - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/*.json")):
    d=json.load(open(f))
    for c in d.get("capacity",[]):
        for s in c.get("searches",[]):
            print(c["model"]["name"], c["cap_gib"], s["mode"], s.get("longest"), s.get("stopped"), [(p['seq'],p['fits'],round(p['wall_s'],1), (p.get('note') or '')[:40], p.get('step_s') and round(p['step_s'],3), p.get('peak_alloc_bytes') and round(p['peak_alloc_bytes']/2**30,2), p.get('peak_bytes') and round(p['peak_bytes']/2**30,2)) for p in s.get('probes',[])])
P
