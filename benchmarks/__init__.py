"""The product benchmarks (run as `python -m benchmarks.<name>` from the repository root); `common` is what they
share. Not part of the wheel."""
