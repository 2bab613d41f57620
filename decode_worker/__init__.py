"""The decode pod: its plug-in of the worker process (role.py), started by `kvferry decode`."""
