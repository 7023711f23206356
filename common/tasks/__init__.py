"""What is learned and how it is scored. Prompt data sets, reward functions and graders,
evaluation benchmarks, the toy tasks and the real pretrained model that needs no hub."""
