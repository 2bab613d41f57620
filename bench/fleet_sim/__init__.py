"""A discrete-event simulator of a kvferry fleet: simulated workers whose steps take what the capacity model
(common/capacity.py) says, behind the router's own placement and admission code (router/decision/dispatch.py) and the
planner's own decisions (planner/core.py)."""
