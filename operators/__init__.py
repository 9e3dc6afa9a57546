"""changeforge operators: pure numpy/rasterio cores and the thin Ray Data operators over them."""
