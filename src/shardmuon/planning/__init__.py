"""What is computed once from the parameters and settings, before any step runs.

``pieces`` (range arithmetic: which global rows and columns a rank holds), ``placements``
(DTensor placements -> a matrix layout and its process groups), ``batches`` (matrices of one
layout grouped into batches, with their owners), ``workspace`` (the bytes a batch holds and
the schedule of phases under the budget), ``plan`` (all of it for one optimizer, and the
chunk descriptions).
"""
