"""The fault-injection suite (`make chaos`, bench/chaos.py; docs/chaos.md).

`table`: a row's result, its accounting and the table (pure); `runner`: `Fault`, `run_row`;
`faults`: the faults.
"""
