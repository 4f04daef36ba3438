"""Many documents, one model load: `qspec summarize FILE|DIR... -o out.jsonl`.

inputs.py    FILE|DIR... -> the documents, sorted (folders give their text files)
records.py   the JSONL output: whole-line appends, a torn last line repaired, one writer
job.py       the settings of a batch and the summary of one document (or its error)
workers.py   where the documents run: this process, or N local processes
ray_pool.py  ... or Ray actors on a cluster (`--ray ADDRESS|local`; the `ray` extra)
run.py       the driver: what is left to do (resume), the records written as they come
"""
