# tune.py candidate micro-4-compile-1-auto-default-threads-0
# reproduce: python train.py config/tuned/micro-4-compile-1-auto-default-threads-0.py
name = 'micro-4-compile-1-auto-default-threads-0'
micro_batch_size = 4
compile = True
