"""What a `model=` string names and how its tower is built: presets (random weights), local Hugging Face checkpoint
directories, Hugging Face Hub ids. Imports no torch at import time (the driver checks a model without it)."""
