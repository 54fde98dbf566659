"""Write this worker's whole environment to OUT/env_<RANK>.json."""
import json
import os
import sys

out = sys.argv[1]
tmp = os.path.join(out, f".env_{os.environ['RANK']}.tmp")
with open(tmp, "w") as fh:
    json.dump(dict(os.environ), fh, indent=1, sort_keys=True)
os.replace(tmp, os.path.join(out, f"env_{os.environ['RANK']}.json"))
