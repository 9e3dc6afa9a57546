"""The pairs job's cores and Ray operators, one subpackage per step, listed so that each imports
only from steps above it (tests/project/test_import_graph.py fails on any cycle):

- ``imagery``: pixel grids and windowed raster reads, radiometric stretches, cloud-mask pixels;
- ``registration``: the registration core (settings, features, matching, the checked fit, tiles);
- ``screening``: the dense shift field of a registered crop, its verdict and rescue;
- ``catalogue``: scene inputs and headers, STAC items, per-band manifests and band stacks;
- ``selection``: pairing scenes, assigning splits, slicing a pair into windows;
- ``labels``: the annotators' label maps and their merge;
- ``crops``: one slice's crop: reading both dates, warping, screening, writing crop and records;
- ``regional``: the regional method's tile graph and its Ray operators;
- ``stage``: the job's Ray stages (cataloguing, cutting, registering slices, merging labels).
"""
