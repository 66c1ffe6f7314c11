"""The engine (intake, the step, outputs) and the loop that runs it on a thread of its own;
request validation and incremental detokenization, which run on either side of it."""
