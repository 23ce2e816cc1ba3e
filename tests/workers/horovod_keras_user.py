"""A Horovod user's Keras script, as written for Horovod: it imports
``horovod.tensorflow.keras`` and nothing of bagua_hvd (tests/test_as_horovod.py runs it with
BAGUA_HVD_AS_HOROVOD, and a copy with the import line rewritten to bagua_hvd). Each rank prints
one ``RESULT {json}`` line: the weights after ``model.fit`` with hvd.DistributedOptimizer and
an allreduce's sum."""

import json

import horovod.tensorflow.keras as hvd
import keras
import numpy as np

hvd.init()
keras.utils.set_random_seed(hvd.rank())  # the replicas start different: rank 0's wins
rng = np.random.default_rng(100 + hvd.rank())  # each rank its own data
x = rng.normal(size=(16, 4)).astype("float32")
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32") + 0.25
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
start = [w.tolist() for w in model.get_weights()]
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
model.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip

total = hvd.allreduce(np.arange(4, dtype=np.float32) * (hvd.rank() + 1), op=hvd.Sum)
result = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "module": hvd.__name__,
    "start": start,
    "x": x.tolist(),
    "y": y.tolist(),
    "weights": [w.tolist() for w in model.get_weights()],
    "total": np.asarray(total).tolist(),
}
print("RESULT " + json.dumps(result), flush=True)
