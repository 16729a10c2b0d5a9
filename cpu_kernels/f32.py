# TEMP STUB (ops helper) - deleted before the ops helper finishes
QTYPE = None
