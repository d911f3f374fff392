"""Compatibility entry point: ``python -m server.cli`` runs ``kvserve.cli`` (the CLI sits above server/)."""
if __name__ == "__main__":
    import sys
    from runpy import run_module

    sys.argv[0] = "kvserve"
    run_module("kvserve.cli", run_name="__main__", alter_sys=True)
