"""The registration core: SIFT features, matching (plain and guided), the checked homography fit."""
