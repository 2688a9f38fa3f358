"""What every suite shares: records (results files, the tree's hash), timing, measured floors, checks,
and the V4-Flash slice the engine suites run."""
