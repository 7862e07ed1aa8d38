"""ResNet-50 v1.5 on ImageNet (MLPerf Training's image classification benchmark)."""
