"""Example inputs shipped with Kvasir (``kvasir plan --devices`` fleets); see docs/planner.md."""

from pathlib import Path

#: The folder holding the example files, in a checkout or an installed wheel.
FOLDER = Path(__file__).resolve().parent
