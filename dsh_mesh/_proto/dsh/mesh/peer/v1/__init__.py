"""Generated package (scripts/gen_protos.py); never edit by hand."""
