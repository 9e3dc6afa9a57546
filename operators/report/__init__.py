"""The dataset report (the paper's Tables III and V, Figs. 2, 4, 5, 7, 8): statistics from the jobs'
Parquet tables (stats, pure pandas), figures (matplotlib) and one self-contained HTML page."""
