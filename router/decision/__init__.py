"""Where a request goes: the workers and their loads, prefix locality, admission, cost model and placement."""
