"""One slice's crop: reading both dates, warping the post date, screening and writing the crop and its records."""
