"""The Ray stages of the pairs job: cataloguing, cutting, registering slices (both methods) and merging labels."""
