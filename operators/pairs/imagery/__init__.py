"""Reading imagery: pixel grids and windowed raster reads, radiometric stretches, cloud-mask pixel tests."""
