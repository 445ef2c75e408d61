"""One-off kernel and process experiments (`python -m benchmarks.experiments.<name>`): each docstring ends with
what it answered. Kept to re-ask the question on another GPU or stack, not run by default."""
