"""Label Studio, the one client the annotation and the review both use (:mod:`operators.labelstudio.client`)."""
