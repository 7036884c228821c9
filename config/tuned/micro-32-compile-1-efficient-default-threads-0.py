# tune.py candidate micro-32-compile-1-efficient-default-threads-0
# reproduce: python train.py config/tuned/micro-32-compile-1-efficient-default-threads-0.py
name = 'micro-32-compile-1-efficient-default-threads-0'
micro_batch_size = 32
compile = True
sdpa_backend = 'efficient'
