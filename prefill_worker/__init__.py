"""The prefill pod: its plug-in of the worker process (role.py), started by `kvferry prefill`."""
