"""ClientApp: local training on the node's partition; replies with its model (and, for cnn, its BatchNorm state)."""
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .task import cfg, cnn_eval, cnn_train, image_data, linear_data, linear_loss, linear_train, make_cnn



def _compress(msg: Message, context: Context, call_next) -> Message:
    """The server's train config may ask for compressed replies ("compress": "int8:block=256", ...): then the
    reply's update goes through fastagg's compress_mod (imported only then: the linear model's clients never load
    torch)."""
    configs = list(msg.content.config_records.values()) if msg.metadata.message_type == "train" else []
    spec = str(configs[0].get("compress", "")) if configs else ""
    if not spec:
        return call_next(msg, context)
    from fastagg.flower import compress_mod

    return compress_mod(spec)(msg, context, call_next)


app = ClientApp(mods=[_compress])


def _partition(context: Context) -> int:
    return int(context.node_config.get("partition-id", 0))


def _numpy(record: ArrayRecord) -> dict:
    return {k: a.numpy() for k, a in record.items()}


def _load_cnn(record: ArrayRecord):
    import torch

    net = make_cnn()
    # the server may send float64 (Flower's own FedAdam does after a round): load_state_dict casts to float32
    net.load_state_dict({k: torch.from_numpy(v) for k, v in _numpy(record).items()})
    return net


@app.train()
def train(msg: Message, context: Context) -> Message:
    steps, lr = int(cfg(context.run_config, "local-steps")), float(cfg(context.run_config, "lr"))
    mu = float(msg.content["config"].get("proximal-mu", 0.0))
    if cfg(context.run_config, "model") == "linear":
        x, y = linear_data(_partition(context))
        m = linear_train(_numpy(msg.content["arrays"]), x, y, steps, lr, mu)
        arrays, loss = ArrayRecord({k: Array(v) for k, v in m.items()}), linear_loss(m, x, y)
    else:
        x, y = image_data(_partition(context))
        net = _load_cnn(msg.content["arrays"])
        loss = cnn_train(net, x, y, steps, lr, mu)
        arrays = ArrayRecord(net.state_dict())
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(y)})
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    if cfg(context.run_config, "model") == "linear":
        x, y = linear_data(_partition(context))
        metrics = {"eval-loss": linear_loss(_numpy(msg.content["arrays"]), x, y)}
    else:
        x, y = image_data(_partition(context))
        loss, acc = cnn_eval(_load_cnn(msg.content["arrays"]), x, y)
        metrics = {"eval-loss": loss, "eval-accuracy": acc}
    return Message(content=RecordDict({"metrics": MetricRecord({**metrics, "num-examples": len(y)})}), reply_to=msg)
